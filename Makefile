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

# Every torch process of the suite on one thread (OMP_NUM_THREADS=1): the tiny models' ops gain little
# from a second thread, and the cores serve one test each instead. First the single-process tests on
# every core (pytest-xdist), then the multi-process ones, a test file per worker (--dist loadfile keeps
# a file's shared runs in one worker). Measured on 2 cores: the second half 1,012 s one test at a
# time with torch's default threads, 743 s like this (-n 3: 747 s).
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto -m "not slow" --durations=15
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadfile -m slow --durations=15

test-fast: setup
	$(PY) -m pytest -q -n auto -m "not slow"

lint: setup
	$(PY) -m ruff check .
