"""PretrainDataModule: build once, batches per optimizer step, exact resume through Lightning."""

from __future__ import annotations

import ast
import gzip
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from omegaconf import DictConfig

from data_contract.errors import ConfigError
from dsl_lit.config.data import DataConfig
from dsl_lit.data.datamodule import PretrainDataModule
from dsl_lit.data.packed import PackedTokens
from tests.conftest import scratch_dir

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "data" / "corpus"
SEQ, G = 32, 8


@pytest.fixture(scope="module")
def small_corpus(request: pytest.FixtureRequest) -> Path:
    """A slice of the bundled corpus: 120 dictionary entries and 30 Bible chapters."""
    out = scratch_dir(request, "corpus")
    for name, count in (("devils_dictionary.jsonl.gz", 120), ("kjv_bible.jsonl.gz", 30)):
        with gzip.open(CORPUS / name, "rt", encoding="utf-8") as src, gzip.open(out / name, "wt") as dst:
            for _, line in zip(range(count), src):
                dst.write(line)
    return out


def make_cfg(corpus: Path, cache: Path, **kw: object) -> DataConfig:
    args = {"tokenizer_vocab_size": 512, "seq_len": SEQ, "global_batch_size": G, "micro_batch_size": 2, **kw}
    return DataConfig(corpus_dir=str(corpus), cache_dir=str(cache), **args)


@pytest.fixture(scope="module")
def cfg(small_corpus: Path, request: pytest.FixtureRequest) -> DataConfig:
    cfg = make_cfg(small_corpus, scratch_dir(request, "cache"))
    PretrainDataModule(cfg).prepare_data()
    return cfg


def first_batches(dm: PretrainDataModule, n: int) -> list[dict[str, torch.Tensor]]:
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def test_config_validation_names_fields(tmp_path: Path) -> None:
    ok = make_cfg(tmp_path, tmp_path)
    assert ok.validate(dp_size=4) is ok
    with pytest.raises(
        ConfigError, match=r"data\.global_batch_size=8 .*data\.micro_batch_size=2 x .* 8 = 16"
    ):
        ok.validate(dp_size=8)
    with pytest.raises(ConfigError, match=r"data\.seq_len=0"):
        make_cfg(tmp_path, tmp_path, seq_len=0).validate()
    with pytest.raises(ConfigError, match=r"data\.tokenizer_vocab_size=100"):
        make_cfg(tmp_path, tmp_path, tokenizer_vocab_size=100).validate()
    with pytest.raises(ConfigError, match=r"data\.tokenizer_max_bytes=0"):
        make_cfg(tmp_path, tmp_path, tokenizer_max_bytes=0).validate()


def test_batches_are_global_batches_of_shifted_windows(cfg: DataConfig) -> None:
    dm = PretrainDataModule(cfg)
    dm.setup("fit")
    meta = dm.tokenizer_meta
    assert meta["padded_vocab_size"] % 128 == 0 and meta["eos_id"] == 1
    batch = first_batches(dm, 1)[0]
    assert batch["input_ids"].shape == batch["labels"].shape == (G, SEQ)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    window = next(iter(dm.batch_sampler()))[0]
    expected = torch.from_numpy(dm.tokens.window(window * SEQ, SEQ + 1).astype("int64"))
    assert torch.equal(batch["input_ids"][0], expected[:-1]) and torch.equal(batch["labels"][0], expected[1:])
    assert int(batch["input_ids"].max()) < meta["vocab_size"]


def test_prepare_data_reuses_a_complete_build(cfg: DataConfig) -> None:
    meta = Path(cfg.cache_dir) / "shards" / "meta.json"
    before = meta.stat().st_mtime_ns
    PretrainDataModule(cfg).prepare_data()
    assert meta.stat().st_mtime_ns == before


def test_concurrent_prepare_builds_once(
    small_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_cfg(small_corpus, tmp_path / "cache", tokenizer_max_bytes=60_000)
    caplog.set_level(logging.INFO, logger="dsl_lit.data.cache")
    threads = [threading.Thread(target=PretrainDataModule(cfg).prepare_data) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum("trained tokenizer" in r.getMessage() for r in caplog.records) == 1
    dm = PretrainDataModule(cfg)
    dm.setup()
    assert dm.num_windows > 0
    assert (
        sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".") and "tmp" in p.name)
        == []
    )


def test_state_dict_round_trip_resumes_exactly(cfg: DataConfig) -> None:
    dm = PretrainDataModule(cfg)
    full = first_batches(dm, 5)
    resumed = PretrainDataModule(cfg)
    resumed.load_state_dict({**dm.state_dict(), "consumed_samples": 3 * G})
    assert resumed.state_dict()["consumed_samples"] == 3 * G
    for a, b in zip(full[3:], first_batches(resumed, 2)):
        assert torch.equal(a["input_ids"], b["input_ids"])


class _Recorder(L.LightningModule):
    """Trains an embedding on the batches and keeps what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(512, 4)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["input_ids"].clone())
        return self.emb(batch["input_ids"]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(max_steps: int, root: Path, **kw: object) -> L.Trainer:
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=root,
        **kw,
    )


def test_lightning_checkpoint_resume_continues_the_stream(cfg: DataConfig, tmp_path: Path) -> None:
    straight = _Recorder()
    _trainer(5, tmp_path).fit(straight, datamodule=PretrainDataModule(cfg))

    first = _Recorder()
    trainer = _trainer(2, tmp_path)
    dm = PretrainDataModule(cfg)
    trainer.fit(first, datamodule=dm)
    assert dm.state_dict()["consumed_samples"] == 2 * G
    trainer.save_checkpoint(tmp_path / "step2.ckpt")

    second = _Recorder()
    resumed_dm = PretrainDataModule(cfg)
    _trainer(5, tmp_path).fit(second, datamodule=resumed_dm, ckpt_path=tmp_path / "step2.ckpt")
    assert resumed_dm.state_dict()["consumed_samples"] == 5 * G
    seen = first.seen + second.seen
    assert len(seen) == len(straight.seen) == 5
    assert all(torch.equal(a, b) for a, b in zip(seen, straight.seen))


class _DataParallelView(SingleDeviceStrategy):
    """A one-process strategy whose step runner reports rank 1 of 2 data-parallel ranks."""

    step_runner = types.SimpleNamespace(dp_rank=1, dp_size=2)


def test_dp_coordinates_come_from_the_step_runner(cfg: DataConfig, tmp_path: Path) -> None:
    dm1 = PretrainDataModule(cfg)
    assert dm1.dp_coordinates() == (0, 1)
    global_batch = first_batches(dm1, 1)[0]

    dm = PretrainDataModule(cfg)
    dm.trainer = _trainer(1, tmp_path, strategy=_DataParallelView(device=torch.device("cpu")))
    assert dm.dp_coordinates() == (1, 2)
    local = first_batches(dm, 1)[0]
    assert local["input_ids"].shape == (G // 2, SEQ)
    assert torch.equal(local["input_ids"], global_batch["input_ids"][G // 2 :])


def test_accepts_the_composed_hydra_data_node(compose_cfg: Callable[[str], DictConfig]) -> None:
    node = compose_cfg("pretrain").data
    dm = PretrainDataModule(node)
    assert isinstance(dm.cfg, DataConfig) and dm.cfg.seq_len == node.seq_len
    assert Path(dm.cfg.corpus_dir) == CORPUS
    with pytest.raises(ConfigError, match=r"data\.seq_lenn"):
        PretrainDataModule({"corpus_dir": "c", "cache_dir": "d", "seq_lenn": 3})


def test_dsl_lit_never_imports_data_pipeline() -> None:
    """The trainer and the pipeline share only ``data_contract.format``: no module of ``dsl_lit``
    imports ``data_pipeline``, and importing every data module leaves it unloaded."""
    offenders = []
    for path in sorted((ROOT / "src" / "dsl_lit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [
                f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "data_pipeline"
            ]
    assert offenders == []
    modules = sorted(p.stem for p in (ROOT / "src" / "dsl_lit" / "data").glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module('dsl_lit.data.' + m)\n"
        "print(len(sys.modules), 'data_pipeline' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split()[1] == "False", out.stdout


# -- the cache is keyed by the corpus ---------------------------------------------------------------
def _jsonl_corpus(directory: Path, texts: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": f"d{i}", "text": t}) for i, t in enumerate(texts)]
    (directory / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


def _stream(cache: Path) -> np.ndarray:
    tokens = PackedTokens(cache / "shards")
    return tokens.window(0, len(tokens))


TEXTS = [
    f"Entry {i}: the {w} of a thing is what it was made for, and little else."
    for i, w in enumerate(["purpose", "use", "end", "aim", "point", "goal"] * 4)
]


def test_a_missing_corpus_fails_at_validation_naming_data_corpus_dir(
    compose_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    node = compose_cfg("pretrain", [f"data.corpus_dir={tmp_path / 'nonexistent' / 'corpus'}"]).data
    with pytest.raises(ConfigError, match=r"data\.corpus_dir=.*nonexistent/corpus is not a directory"):
        PretrainDataModule(node)


def test_another_corpus_in_the_same_cache_rebuilds(small_corpus: Path, tmp_path: Path) -> None:
    other = _jsonl_corpus(tmp_path / "other", TEXTS)
    cfg = make_cfg(small_corpus, tmp_path / "cache")
    PretrainDataModule(cfg).prepare_data()
    first = _stream(tmp_path / "cache")
    PretrainDataModule(make_cfg(other, tmp_path / "cache")).prepare_data()
    meta = json.loads((tmp_path / "cache" / "shards" / "meta.json").read_text())
    assert meta["corpus"]["path"] == str(other.resolve()) and meta["num_documents"] == len(TEXTS)
    assert len(_stream(tmp_path / "cache")) < len(first)


def test_the_same_corpus_at_another_path_is_served_without_a_rebuild(small_corpus: Path, tmp_path: Path) -> None:
    """A moved checkout or a git worktree: the corpus's content is the cache's key, not its path (a
    path key made the data module rebuild, the pipeline skip its finished work on the same content,
    and the build then fail as still stale)."""
    cfg = make_cfg(small_corpus, tmp_path / "cache")
    PretrainDataModule(cfg).prepare_data()
    shards = tmp_path / "cache" / "shards" / "meta.json"
    written = shards.stat().st_mtime_ns
    moved = tmp_path / "moved_checkout" / "corpus"
    shutil.copytree(small_corpus, moved)
    PretrainDataModule(make_cfg(moved, tmp_path / "cache")).prepare_data()
    assert shards.stat().st_mtime_ns == written  # nothing rebuilt


def test_an_edit_keeping_size_and_mtime_rebuilds(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corpus = _jsonl_corpus(tmp_path / "corpus", TEXTS)
    cfg = make_cfg(corpus, tmp_path / "cache")
    PretrainDataModule(cfg).prepare_data()
    before = _stream(tmp_path / "cache")
    path = corpus / "docs.jsonl"
    st = path.stat()
    path.write_text(path.read_text(encoding="utf-8").replace("little", "LITTLE"), encoding="utf-8")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    caplog.set_level(logging.INFO, logger="dsl_lit.data.cache")
    PretrainDataModule(cfg).prepare_data()
    assert any("not from data.corpus_dir as it is now" in r.getMessage() for r in caplog.records)
    assert not np.array_equal(_stream(tmp_path / "cache"), before)


def test_a_hand_made_pipeline_run_is_never_rebuilt_by_the_data_module(tmp_path: Path) -> None:
    """A pipeline output made with other stages (dedup, filters) for another corpus is refused,
    naming data.cache_dir, instead of being overwritten with an unfiltered build."""
    corpus = _jsonl_corpus(tmp_path / "corpus", TEXTS)
    cache = tmp_path / "pipeline_out"
    command = [
        sys.executable,
        "-m",
        "data_pipeline",
        f"input.path={corpus}",
        f"output_dir={cache}",
        "stages=[exact_dedup,train_tokenizer,tokenize_pack]",
        "tokenizer.vocab_size=512",
        "tokenizer.max_bytes=null",
        "tokenizer.padded_vocab_size=null",
    ]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    PretrainDataModule(make_cfg(corpus, cache)).prepare_data()  # current: used as it is
    other = _jsonl_corpus(tmp_path / "other", TEXTS[:5])
    before = (cache / "shards" / "meta.json").read_bytes()
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.*stages=\['exact_dedup'"):
        PretrainDataModule(make_cfg(other, cache)).prepare_data()
    assert (cache / "shards" / "meta.json").read_bytes() == before
