"""Chat data of post-training: conversations (``conversations``: the task's or a JSONL file's),
encoded with the tokenizer's chat template and its loss mask (``tokenizer``), made into padded or
packed rows (``rows``) and served by ``datamodule.RowsDataModule``."""
