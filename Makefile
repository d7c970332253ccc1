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

test: setup
	$(PY) -m pytest -q --durations=30

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(PY) -m ruff check .
