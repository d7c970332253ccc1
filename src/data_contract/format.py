"""The contract between the data pipeline and the trainer: the packed-shard layout and token names.

Why one small module: ``data_pipeline`` writes these files and ``dsl_lit.data`` reads them, and
neither imports the other. Everything both sides must agree on (directory and file names, the
token dtype, the meta keys, the special tokens) is written here once.

An output directory of the pipeline (the data module's ``data.cache_dir``)::

    tokenizer/            tokenizer.json (+ transformers' configs), meta.json written last
    shards/
      shard-00000.bin       tokens, little-endian uint16 (padded vocab <= 65536) or uint32;
                            an EOS follows every document
      shard-00000.idx.npy   int64 cumulative document end offsets within that shard
      ...
      meta.json             written last: its presence marks a complete dataset

Shards roll at document boundaries (a shard exceeds its token budget only to hold one huge
document), so each shard's index describes whole documents. ``shards/meta.json`` holds
``format_version``, ``dtype``, ``num_tokens``, ``num_documents``, ``num_empty_skipped``, ``shards``
(``file``, ``num_tokens``, ``num_documents`` each), ``eos_id``, ``vocab_size``,
``padded_vocab_size``, ``tokenizer_sha256`` (of the tokenizer.json it was encoded with),
``corpus`` (the input it was built from: ``data_contract.corpus.corpus_record``) and ``stages`` (the
pipeline stages that produced it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
META_FILE = "meta.json"  # in tokenizer/ and in shards/; written last
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
SHARDS_DIR = "shards"

# The bundled demo tokenizer's special tokens, in id order 0..14: DeepSeek's names for bos/eos/pad,
# fill-in-the-middle and the chat roles, R1's reasoning tags, and place holders. This set is ours;
# the released tokenizers' added tokens (ids, special flags) are in data_pipeline/tokenizer/specs/.
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
FIM_BEGIN_TOKEN = "<｜fim▁begin｜>"
FIM_HOLE_TOKEN = "<｜fim▁hole｜>"
FIM_END_TOKEN = "<｜fim▁end｜>"
FIM_TOKENS = (FIM_BEGIN_TOKEN, FIM_HOLE_TOKEN, FIM_END_TOKEN)
"""Fill-in-the-middle (DeepSeek-V3 section 4.1): ``begin prefix hole suffix end middle``."""
DEEPSEEK_SPECIAL_TOKENS: list[str] = [
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    FIM_HOLE_TOKEN,
    FIM_BEGIN_TOKEN,
    FIM_END_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<｜place▁holder▁no▁0｜>",
    "<｜place▁holder▁no▁1｜>",
    "<｜place▁holder▁no▁2｜>",
]


def token_dtype(padded_vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned dtype that holds every id: halves the bytes for <= 64K vocabs."""
    if padded_vocab_size <= 0:
        raise ValueError(f"padded_vocab_size must be positive, got {padded_vocab_size}")
    return np.dtype("<u2") if padded_vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def index_name(index: int) -> str:
    return f"shard-{index:05d}.idx.npy"


def file_sha256(path: Path) -> str:
    """SHA-256 of a file (``tokenizer_sha256``: which tokenizer a packed dataset was encoded with)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
