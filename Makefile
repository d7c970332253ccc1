# The two commands of the README. Both set up .venv first (scripts/setup.sh, idempotent).
PY := .venv/bin/python

.PHONY: setup demo reproduce test test-fast lint

setup:
	@scripts/setup.sh

# The data pipeline (dedup, filters, decontamination against the bundled eval tasks, tokenizer, packing)
# cleans the bundled corpus, then pretraining
# reads its shards. Reruns skip the pipeline's finished work.
DEMO_DATA := $(CURDIR)/.cache/pipeline_demo

demo: setup
	$(PY) -m data_pipeline input.path=data/corpus output_dir=$(DEMO_DATA) quality_filter=bundled tokenizer=bundled \
		'stages=[normalize,exact_dedup,near_dedup,quality_filter,language_filter,decontaminate,train_tokenizer,tokenize_pack]'
	$(PY) recipes/pretrain.py data.cache_dir=$(DEMO_DATA)

# DeepSeek's method end to end on the bundled corpus (recipes/reproduce.py, conf/reproduce/cpu_mini.yaml):
# scaling laws -> data pipeline -> V3 pretraining (+ ablations) -> YaRN -> R1 (cold start, GRPO,
# rejection sampling + SFT, distillation) -> lm-eval -> outputs/reproduce/cpu_mini/report/report.md.
# A rerun skips finished stages and resumes an interrupted one; ARGS= passes overrides, e.g.
# make reproduce ARGS="reproduce=gpu_small"
reproduce: setup
	$(PY) recipes/reproduce.py $(ARGS)

# Every torch process of the suite on one thread (OMP_NUM_THREADS=1): the tiny models' ops gain little
# from a second thread, and the cores serve one test each instead. One pytest run on every core
# (pytest-xdist), a test file per worker at a time (--dist loadfile: a file's multi-process tests,
# marked slow, share module-scoped runs), the longest files first by the seconds tests/durations.json
# recorded (tests/conftest.py; scripts/record_test_durations.py refreshes it from a --junitxml report).
# `make test-fast` runs the unit and architecture trees (tests/unit mirrors the packages), slow tests left out.
# one more pytest worker than cores, at least 3: the tests wait about half their time on process
# start-up, collectives and files (2 workers kept 2 cores 47% busy; 3 workers: 1,106 s -> 999 s here;
# 4 workers: 1,019 s)
TEST_WORKERS ?= $(shell python3 -c "import os; print(max(3, (os.cpu_count() or 1) + 1))")

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

test-fast: setup
	$(PY) -m pytest -q -n auto -m "not slow" tests/unit tests/architecture

lint: setup
	$(PY) -m ruff check .
