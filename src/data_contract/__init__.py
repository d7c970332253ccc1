"""What the data pipeline (``data_pipeline``) and the trainer (``dsl_lit``) agree on, and the only
code both import: neither imports the other.

- ``format``: the packed-shard layout and tokenizer-directory file names the pipeline writes and
  the data module reads;
- ``corpus``: the corpus fingerprint both compare (a cache built from other documents is rebuilt);
- ``tokenizer_dir``: a tokenizer directory's ``meta.json``, written by one side, read by the other;
- ``chat_template``: the bounded Jinja sandbox (chat templates, lm-eval prompt templates);
- ``fs``: atomic publication of a directory (it appears whole or not at all);
- ``errors`` and ``schema``: one-line config errors (exit 2) and the dataclass reader that names a
  wrong field, so both programs refuse bad input alike.

It imports neither side (``tests/architecture/test_import_layers.py``).
"""
