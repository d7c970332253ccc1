# The two commands of the README. Both set up .venv first (scripts/setup.sh, idempotent).
PY := .venv/bin/python

.PHONY: setup demo test test-fast lint

setup:
	@scripts/setup.sh

# The data pipeline (dedup, filters, tokenizer, packing) cleans the bundled corpus, then pretraining
# reads its shards. Reruns skip the pipeline's finished work.
DEMO_DATA := $(CURDIR)/.cache/pipeline_demo

demo: setup
	$(PY) -m data_pipeline input.path=data/corpus output_dir=$(DEMO_DATA) quality_filter=bundled tokenizer=bundled \
		'stages=[normalize,exact_dedup,near_dedup,quality_filter,language_filter,train_tokenizer,tokenize_pack]'
	$(PY) recipes/pretrain.py data.cache_dir=$(DEMO_DATA)

# The single-process tests on every core (pytest-xdist: ~1.9x on 2 cores), then the multi-process
# ones alone: they already fill the cores, and two at once only add up (measured: 1020 s either way).
test: setup
	$(PY) -m pytest -q -n auto -m "not slow" --durations=15
	$(PY) -m pytest -q -m slow --durations=15

test-fast: setup
	$(PY) -m pytest -q -n auto -m "not slow"

lint: setup
	$(PY) -m ruff check .
