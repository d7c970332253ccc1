"""The pipeline's configuration as dataclasses, validated before any work starts.

Why dataclasses behind the Hydra YAML: a typo or an out-of-range value fails at start-up with a
message naming the field (``near_dedup.threshold``) and the fix, not hours later in a worker.
"""

from __future__ import annotations

import dataclasses
import dataclasses as dc
import typing
from dataclasses import dataclass
from typing import Any

from dsl_lit.config.errors import ConfigError
from dsl_lit.config.schema import dataclass_from_dict

STAGES = (
    "normalize",
    "exact_dedup",
    "near_dedup",
    "quality_filter",
    "language_filter",
    "remix",
    "train_tokenizer",
    "tokenize_pack",
)
TOKENIZER_STAGES = ("train_tokenizer", "tokenize_pack")


def _fraction(prefix: str, name: str, value: float, low: float = 0.0, high: float = 1.0) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{prefix}.{name}={value} must lie in [{low}, {high}]")


@dataclass
class InputConfig:
    path: str = (
        ""  # a directory (of .txt/.jsonl/.jsonl.gz/.parquet files), a glob, a file, or a saved dataset
    )
    text_field: str = "text"
    id_field: str = "id"  # documents without one get "<file>:<line>" (or "<file>:<row>")
    source_field: str = "source"  # copied to the `source` column; defaults to the file's name
    metadata_fields: list[str] = dc.field(default_factory=list)  # other fields kept as string columns
    files_per_shard: int = 1000  # .txt inputs: documents (files) per shard
    rows_per_shard: int = 100_000  # a saved dataset is cut into shards of this many rows

    def validate(self) -> InputConfig:
        if not self.path:
            raise ConfigError("input.path is empty: pass input.path=<dir|glob|file|saved dataset>")
        for name in ("files_per_shard", "rows_per_shard"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"input.{name}={getattr(self, name)} must be a positive integer")
        return self


@dataclass
class NormalizeConfig:
    form: str = "NFC"  # Unicode normal form: NFC, NFKC, NFD, NFKD, or none
    strip_control: bool = True  # drop control and format characters except \t and \n
    unify_newlines: bool = True  # \r\n and \r -> \n
    collapse_spaces: bool = True  # runs of horizontal whitespace -> one space; trailing spaces cut
    max_newlines: int = 2  # longer runs of line breaks are cut to this many (0: keep all)
    strip: bool = True  # no leading or trailing whitespace

    def validate(self) -> NormalizeConfig:
        if self.form not in ("NFC", "NFKC", "NFD", "NFKD", "none"):
            raise ConfigError(f"normalize.form={self.form!r} must be one of NFC, NFKC, NFD, NFKD, none")
        if self.max_newlines < 0:
            raise ConfigError(
                f"normalize.max_newlines={self.max_newlines} must be >= 0 (0 keeps every line break)"
            )
        return self


@dataclass
class ExactDedupConfig:
    partitions: int = 16  # hash-range partitions resolved in parallel (units of the resolve step)

    def validate(self) -> ExactDedupConfig:
        if not 1 <= self.partitions <= 4096:
            raise ConfigError(f"exact_dedup.partitions={self.partitions} must lie in [1, 4096]")
        return self


@dataclass
class NearDedupConfig:
    ngram: int = 5  # words per shingle
    num_perm: int = 112  # MinHash values per document
    scheme: str = "oph"  # oph (one-permutation + densification) | classic
    seed: int = 1
    threshold: float = 0.8  # Jaccard similarity from which a document is a near duplicate
    min_recall: float = 0.95  # LSH candidate probability wanted at exactly `threshold` (picks bands x rows)
    bands: int | None = None  # set both bands and rows to override the choice
    rows: int | None = None
    verify: str = "exact"  # exact (shingle sets) | signature (MinHash estimate) | none
    batch_size: int = 2000  # documents hashed per numpy batch (memory ~ batch_size x words)
    save_index: bool = False  # write output_dir/near_dedup_index for later runs to dedup against
    against_indexes: list[str] = dc.field(default_factory=list)  # earlier runs' indexes

    def validate(self) -> NearDedupConfig:
        for name in ("ngram", "num_perm", "batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"near_dedup.{name}={getattr(self, name)} must be a positive integer")
        if self.scheme not in ("oph", "classic"):
            raise ConfigError(f"near_dedup.scheme={self.scheme!r} must be oph or classic")
        if self.verify not in ("exact", "signature", "none"):
            raise ConfigError(f"near_dedup.verify={self.verify!r} must be exact, signature or none")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"near_dedup.threshold={self.threshold} must lie in (0, 1), e.g. 0.8")
        _fraction("near_dedup", "min_recall", self.min_recall)
        if (self.bands is None) != (self.rows is None):
            raise ConfigError("near_dedup.bands and near_dedup.rows go together: set both or neither")
        if self.bands is not None and self.rows is not None:
            if self.bands <= 0 or self.rows <= 0 or self.bands * self.rows > self.num_perm:
                raise ConfigError(
                    f"near_dedup.bands x near_dedup.rows = {self.bands} x {self.rows} must be positive and at "
                    f"most near_dedup.num_perm={self.num_perm}"
                )
        return self


@dataclass
class GopherQualityConfig:
    enabled: bool = True
    min_doc_words: int = 50
    max_doc_words: int = 100_000
    min_avg_word_length: float = 3.0
    max_avg_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    max_non_alpha_words_ratio: float = 0.8  # "80% of words must contain an alphabetic character"
    min_stop_words: int = 2
    stop_words: list[str] = dc.field(
        default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"]
    )


@dataclass
class GopherRepetitionConfig:
    enabled: bool = True
    dup_line_frac: float = 0.3
    dup_para_frac: float = 0.3
    dup_line_char_frac: float = 0.2
    dup_para_char_frac: float = 0.2
    top_n_grams: list[list[float]] = dc.field(default_factory=lambda: [[2, 0.2], [3, 0.18], [4, 0.16]])
    dup_n_grams: list[list[float]] = dc.field(
        default_factory=lambda: [[5, 0.15], [6, 0.14], [7, 0.13], [8, 0.12], [9, 0.11], [10, 0.10]]
    )


@dataclass
class C4Config:
    enabled: bool = True
    split_paragraph: bool = True  # lines are \n-separated (False: sentences)
    remove_citations: bool = True  # "[1]", "[citation needed]"
    filter_no_terminal_punct: bool = True  # drop lines not ending in . ! ? " or '
    min_num_sentences: int = 5  # documents with fewer are removed (-1: off)
    min_words_per_line: int = 3  # shorter lines are dropped (-1: off)
    max_word_length: int = 1000  # lines with a longer word are dropped (-1: off)
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True


@dataclass
class FineWebConfig:
    enabled: bool = True
    line_punct_thr: float = 0.12  # removed when fewer lines end in punctuation
    line_punct_exclude_zero: bool = False
    short_line_thr: float = 0.67  # removed when more lines are short
    short_line_length: int = 30
    char_duplicates_ratio: float = 0.01  # removed when more characters are in duplicated lines
    new_line_ratio: float = 0.3  # removed when line breaks per word exceed this


@dataclass
class QualityFilterConfig:
    gopher_quality: GopherQualityConfig = dc.field(default_factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = dc.field(default_factory=GopherRepetitionConfig)
    c4: C4Config = dc.field(default_factory=C4Config)
    fineweb: FineWebConfig = dc.field(default_factory=FineWebConfig)


@dataclass
class LanguageFilterConfig:
    languages: list[str] = dc.field(default_factory=lambda: ["en"])  # ISO 639-1 codes kept
    min_score: float = 0.65  # the top language's probability must reach this

    def validate(self) -> LanguageFilterConfig:
        if not self.languages:
            raise ConfigError("language_filter.languages is empty: list the codes to keep, e.g. [en]")
        _fraction("language_filter", "min_score", self.min_score)
        return self


@dataclass
class RemixConfig:
    field: str = "source"  # the column whose values are mixed
    targets: dict[str, float] = dc.field(default_factory=dict)  # value -> proportion (they sum to 1)
    unit: str = "documents"  # proportions of documents or of UTF-8 bytes
    total: int | None = None  # documents (or bytes) after remixing; null: as many as before
    seed: int = 0

    def validate(self) -> RemixConfig:
        if not self.targets:
            raise ConfigError(
                "remix.targets is empty: give proportions, e.g. remix.targets={web: 0.7, code: 0.3}"
            )
        if any(v < 0 for v in self.targets.values()) or abs(sum(self.targets.values()) - 1.0) > 1e-6:
            raise ConfigError(f"remix.targets={self.targets} must be non-negative and sum to 1")
        if self.unit not in ("documents", "bytes"):
            raise ConfigError(f"remix.unit={self.unit!r} must be documents or bytes")
        if self.total is not None and self.total <= 0:
            raise ConfigError(f"remix.total={self.total} must be positive, or null to keep the current size")
        return self


@dataclass
class TokenizerConfig:
    vocab_size: int = 100_015  # including the special tokens (DeepSeek LLM: 100000 + 15)
    padded_vocab_size: int | None = 102_400  # embedding rows; null: rounded up to a multiple of 128
    special_tokens: list[str] | None = None  # null: DeepSeek LLM's 15 (bos, eos, pad first)
    max_bytes: int | None = 1_000_000_000  # training sample (memory grows with distinct pre-tokens)

    def validate(self) -> TokenizerConfig:
        specials = 15 if self.special_tokens is None else len(self.special_tokens)
        if self.special_tokens is not None and len(self.special_tokens) < 3:
            raise ConfigError("tokenizer.special_tokens must start with bos, eos and pad (at least 3)")
        if self.vocab_size < 256 + specials:
            raise ConfigError(
                f"tokenizer.vocab_size={self.vocab_size} must be at least 256 bytes + {specials} specials"
            )
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ConfigError(
                f"tokenizer.padded_vocab_size={self.padded_vocab_size} is below tokenizer.vocab_size={self.vocab_size}"
            )
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError(
                f"tokenizer.max_bytes={self.max_bytes} must be positive, or null for everything"
            )
        return self


@dataclass
class PackConfig:
    shard_tokens: int = 2**24
    batch_size: int = 1000

    def validate(self) -> PackConfig:
        if self.shard_tokens <= 0 or self.batch_size <= 0:
            raise ConfigError("pack.shard_tokens and pack.batch_size must be positive")
        return self


@dataclass
class PipelineConfig:
    input: InputConfig
    output_dir: str
    stages: list[str] = dc.field(
        default_factory=lambda: ["normalize", "exact_dedup", "near_dedup", "quality_filter"]
    )
    num_proc: int = 1  # worker processes on this machine (units of a step run in parallel)
    step: str | None = None  # run only this step (see `plan`), for cluster schedulers
    task_index: int = 0  # with step: this task takes units task_index, task_index + task_count, ...
    task_count: int = 1
    normalize: NormalizeConfig = dc.field(default_factory=NormalizeConfig)
    exact_dedup: ExactDedupConfig = dc.field(default_factory=ExactDedupConfig)
    near_dedup: NearDedupConfig = dc.field(default_factory=NearDedupConfig)
    quality_filter: QualityFilterConfig = dc.field(default_factory=QualityFilterConfig)
    language_filter: LanguageFilterConfig = dc.field(default_factory=LanguageFilterConfig)
    remix: RemixConfig | None = None
    tokenizer: TokenizerConfig = dc.field(default_factory=TokenizerConfig)
    pack: PackConfig = dc.field(default_factory=PackConfig)

    def validate(self) -> PipelineConfig:
        if not self.output_dir:
            raise ConfigError("output_dir is empty: pass output_dir=<dir>")
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ConfigError(f"stages: unknown stage(s) {unknown}; known stages: {list(STAGES)}")
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError(f"stages={self.stages} names a stage twice")
        doc_positions = [i for i, s in enumerate(self.stages) if s not in TOKENIZER_STAGES]
        tok_positions = [i for i, s in enumerate(self.stages) if s in TOKENIZER_STAGES]
        if doc_positions and tok_positions and max(doc_positions) > min(tok_positions):
            raise ConfigError(f"stages={self.stages}: train_tokenizer and tokenize_pack must come last")
        if "tokenize_pack" in self.stages and "train_tokenizer" in self.stages:
            if self.stages.index("tokenize_pack") < self.stages.index("train_tokenizer"):
                raise ConfigError("stages: train_tokenizer must come before tokenize_pack")
        if "remix" in self.stages and self.remix is None:
            raise ConfigError(
                "stages includes remix but no remix targets are set: pick remix=<preset> or set remix.targets"
            )
        if self.num_proc <= 0:
            raise ConfigError(f"num_proc={self.num_proc} must be a positive integer")
        if self.task_count <= 0 or not 0 <= self.task_index < self.task_count:
            raise ConfigError(f"task_index={self.task_index} must lie in [0, task_count={self.task_count})")
        if self.task_count > 1 and self.step is None:
            raise ConfigError(
                "task_count > 1 needs step=<name>: run each step as its own scheduler array, in the order "
                "`python -m data_pipeline ... +plan=true` prints (see data_pipeline/README.md)"
            )
        return self


def build(schema: type, values: dict[str, Any] | None, prefix: str) -> Any:
    """``values`` (nested plain dicts) -> ``schema``, recursing into dataclass-typed fields."""
    values = dict(values or {})
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        target = kind if dataclasses.is_dataclass(kind) else (args[0] if len(args) == 1 else None)
        if f.name in values and dataclasses.is_dataclass(target):
            if values[f.name] is None:
                continue
            if not isinstance(values[f.name], dict):
                raise ConfigError(f"{prefix}{f.name} must be a mapping, got {values[f.name]!r}")
            values[f.name] = build(target, values[f.name], f"{prefix}{f.name}.")
    return dataclass_from_dict(schema, values, prefix.rstrip(".") or "pipeline")


def load_config(values: dict[str, Any]) -> PipelineConfig:
    """Plain values (a resolved Hydra config) -> a validated ``PipelineConfig``."""
    values = {k: v for k, v in values.items() if k != "plan"}
    return build(PipelineConfig, values, "")
