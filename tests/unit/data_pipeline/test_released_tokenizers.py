"""The ``deepseek_llm`` and ``deepseek_v3`` tokenizer presets against DeepSeek's released tokenizers.

The oracle is ``tests/data/reference/deepseek_tokenizers.json`` (the published tokenizer.json /
tokenizer_config.json of DeepSeek LLM 7B base and DeepSeek-V3, less the vocabulary and merges; a
copy of the project's shared/reference/, or ``DSL_LIT_REFERENCE``). Small tokenizers are
trained with each preset on the bundled corpus (2000 BPE tokens): everything but the learned
merges must equal the release, the added tokens sitting at their released ids (V3's up to
128814, so its packed shards are uint32).
"""

from __future__ import annotations

import json
import os
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from data_contract.errors import ConfigError
from data_contract.format import TOKENIZER_FILE
from data_contract.tokenizer_dir import derive_meta, read_tokenizer_meta
from data_pipeline.config import load_config
from data_pipeline.io.sources import load_documents
from data_pipeline.runner import run
from data_pipeline.tokenizer.spec import load_spec, reserved_token, untrained_tokenizer
from data_pipeline.tokenizer.training import tokenizer_spec, train_tokenizer
from dsl_lit.data.packed import PackedTokens
from tests.conftest import scratch_dir

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "data" / "corpus"
FIXTURE = Path(__file__).resolve().parents[2] / "data" / "multilingual.jsonl"
PRESETS = ("deepseek_llm", "deepseek_v3")
LEARNED = 2000


REFERENCE = Path(__file__).resolve().parents[2] / "data" / "reference" / "deepseek_tokenizers.json"
"""The released tokenizers' facts, kept in the repository (copied from the project's
shared/reference/, whose README beside it names the source: DeepSeek LLM 7B base's and
DeepSeek-V3's published tokenizer.json and tokenizer_config.json), so a plain clone runs these tests."""


def reference_file() -> Path:
    """The released specs: ``$DSL_LIT_REFERENCE`` if set, else the copy in tests/data/reference/."""
    if os.environ.get("DSL_LIT_REFERENCE"):
        return Path(os.environ["DSL_LIT_REFERENCE"])
    return REFERENCE


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(reference_file().read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def corpus_texts(request: pytest.FixtureRequest) -> list[str]:
    files = sorted(CORPUS.glob("*.jsonl.gz"))
    return list(load_documents(files, cache_dir=scratch_dir(request, "hf_datasets"))["text"])


def _variants(text: str) -> list[str]:
    """The text, its NFD and NFC forms, CRLF line ends and surrounding whitespace runs: what a
    pre-tokenizer's whitespace, combining-mark and line-break rules must agree on."""
    forms = [text, unicodedata.normalize("NFD", text), unicodedata.normalize("NFC", text),
             text.replace("\n", "\r\n"), f"   {text}\t \n  "]
    return list(dict.fromkeys(forms))


@pytest.fixture(scope="module")
def documents(corpus_texts: list[str]) -> list[str]:
    """The multilingual fixture (Latin with combining marks, CJK, Cyrillic, Greek, other scripts,
    code, numbers, whitespace runs) in its variants, and every 10th bundled-corpus document."""
    base = [json.loads(line)["text"] for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
    return [v for text in base for v in _variants(text)] + corpus_texts[::10]


@pytest.fixture(scope="module")
def trained(corpus_texts: list[str], request: pytest.FixtureRequest) -> dict[str, Path]:
    """A 2000-token tokenizer of each preset, trained on 1 MB of the bundled corpus."""
    root = scratch_dir(request, "presets")
    return {name: train_tokenizer(corpus_texts, LEARNED, root / name, spec=tokenizer_spec(name),
                                  max_bytes=1_000_000, embedding_size=load_spec(name).embedding_size)
            for name in PRESETS}


def _reference_pre_tokenizer(spec: dict):
    """The release's pre-tokenizer, built by ``tokenizers`` straight from its published JSON."""
    skeleton = json.loads(Tokenizer(models.BPE()).to_str())
    skeleton["pre_tokenizer"] = spec["pre_tokenizer"]
    return Tokenizer.from_str(json.dumps(skeleton)).pre_tokenizer


def agreement(ours, theirs, documents: list[str]) -> int:
    """Documents whose pre-tokens (pieces and offsets) are identical."""
    return sum(ours.pre_tokenize_str(d) == theirs.pre_tokenize_str(d) for d in documents)


@pytest.mark.parametrize("name", PRESETS)
def test_pre_tokenization_is_the_releases_on_a_multilingual_corpus(name, reference, trained, documents):
    theirs = _reference_pre_tokenizer(reference[name])
    ours = Tokenizer.from_file(str(trained[name] / TOKENIZER_FILE)).pre_tokenizer
    assert len(documents) > 400
    assert agreement(ours, theirs, documents) == len(documents)
    # the corpus tells pre-tokenizers apart: the bundled one and the other release split it otherwise
    bundled = untrained_tokenizer(tokenizer_spec("bundled")).pre_tokenizer
    other = _reference_pre_tokenizer(reference[next(p for p in PRESETS if p != name)])
    assert agreement(bundled, theirs, documents) < 0.9 * len(documents)
    assert agreement(other, theirs, documents) < 0.9 * len(documents)


@pytest.mark.parametrize("name", PRESETS)
def test_everything_but_the_merges_is_the_release(name, reference, trained):
    ref = reference[name]
    data = json.loads((trained[name] / TOKENIZER_FILE).read_text(encoding="utf-8"))
    for part in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
        assert data[part] == ref[part], part
    assert data["model"]["type"] == ref["model_type"] == "BPE"
    assert data["model"]["byte_fallback"] is False and not ref["byte_fallback"]
    assert len(data["model"]["vocab"]) == ref["bpe_vocab_size"]  # learned + reserved fillers
    assert [(t["id"], t["content"], t["special"]) for t in data["added_tokens"]] == \
        [(t["id"], t["content"], t["special"]) for t in ref["added_tokens"]]
    config = json.loads((trained[name] / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config == ref["tokenizer_config"]
    tokenizer = Tokenizer.from_file(str(trained[name] / TOKENIZER_FILE))
    for token in ref["added_tokens"]:
        assert tokenizer.token_to_id(token["content"]) == token["id"]
        assert tokenizer.encode(f"a{token['content']}b", add_special_tokens=False).ids.count(token["id"]) == 1
    meta = json.loads((trained[name] / "meta.json").read_text())
    last = max(t["id"] for t in ref["added_tokens"]) + 1
    assert (meta["vocab_size"], meta["learned_vocab_size"]) == (last, LEARNED)
    assert meta["padded_vocab_size"] == {"deepseek_llm": 102400, "deepseek_v3": 129280}[name]
    assert (meta["bos_id"], meta["eos_id"], meta["pad_id"]) == \
        {"deepseek_llm": (100000, 100001, 100001), "deepseek_v3": (0, 1, 1)}[name]


@pytest.mark.parametrize("name", PRESETS)
def test_the_learned_part_round_trips_and_never_produces_a_reserved_id(name, reference, trained, documents):
    """Every byte sequence round-trips, except (as released) DeepSeek LLM's 13 added characters: they
    are the bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5-0xFF), so the byte-level decoder turns
    the text characters they match (ö, ü, ...) into U+FFFD."""
    tokenizer = Tokenizer.from_file(str(trained[name] / TOKENIZER_FILE))
    assert tokenizer.token_to_id(reserved_token(LEARNED)) == LEARNED
    lossy = {t["content"] for t in reference[name]["added_tokens"] if len(t["content"]) == 1}
    assert len(lossy) == {"deepseek_llm": 13, "deepseek_v3": 0}[name]
    assert sorted(ord(c) for c in lossy) == ([0xC0, 0xC1] + list(range(0xF5, 0x100)) if lossy else [])
    for text in documents:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == "".join("\ufffd" if c in lossy else c for c in text)
        assert not [i for i in ids if LEARNED <= i < load_spec(name).bpe_vocab_size]


def test_combining_marks_and_added_characters_split_words_as_released(trained):
    """DeepSeek LLM's pre-tokenizer splits ' Jörg' into ' J', 'ö', 'rg' (the bundled one keeps the
    word), and 'ö' in text is matched as the added token 100003 before pre-tokenization."""
    tokenizer = Tokenizer.from_file(str(trained["deepseek_llm"] / TOKENIZER_FILE))
    pieces = [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(" Jörg")]
    assert pieces == ["ĠJ", "Ã¶", "rg"]
    bundled = untrained_tokenizer(tokenizer_spec("bundled")).pre_tokenizer
    assert [p for p, _ in bundled.pre_tokenize_str(" Jörg")] == ["ĠJÃ¶rg"]
    encoding = tokenizer.encode(" Jörg", add_special_tokens=False)
    assert encoding.tokens[1] == "ö" and encoding.ids[1] == 100003 and "".join(encoding.tokens) == "ĠJörg"


@pytest.mark.parametrize("name", PRESETS)
def test_transformers_loads_it_as_the_release(name, reference, trained):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(trained[name])
    config = reference[name]["tokenizer_config"]
    assert auto.bos_token == config["bos_token"]["content"] and auto.eos_token == config["eos_token"]["content"]
    assert auto.pad_token == config["pad_token"]["content"]
    assert auto.model_max_length == config["model_max_length"]
    assert auto.chat_template == config.get("chat_template")
    tokenizer = Tokenizer.from_file(str(trained[name] / TOKENIZER_FILE))
    text = "Jörg  paid ¥12345 for 中文かな<｜end▁of▁sentence｜> ok\n\n"
    assert auto.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False).ids


def _release_dir(trained: Path, target: Path, embedding: int | None) -> Path:
    """What a model repository ships: tokenizer.json and tokenizer_config.json (+ config.json), no meta.json."""
    target.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(trained / name, target / name)
    if embedding is not None:
        (target / "config.json").write_text(json.dumps({"vocab_size": embedding}))
    return target


def test_a_release_without_meta_is_read_from_its_own_files(trained, tmp_path):
    bare = _release_dir(trained["deepseek_v3"], tmp_path / "bare", None)
    assert derive_meta(bare) == {"vocab_size": 128815, "padded_vocab_size": 128896, "bos_id": 0, "eos_id": 1,
                                 "pad_id": 1}
    model = _release_dir(trained["deepseek_v3"], tmp_path / "model", 129280)
    assert read_tokenizer_meta(model)["padded_vocab_size"] == 129280
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eos_token"):
        derive_meta(bare)


def test_pipeline_packs_with_a_released_tokenizer_as_uint32(trained, tmp_path):
    """``tokenizer.path``: no training; the shards hold ids above 65535; output_dir/tokenizer is a copy
    with a meta.json, the layout the data module reads."""
    release = _release_dir(trained["deepseek_v3"], tmp_path / "DeepSeek-V3", 129280)
    texts = ["<｜User｜>Hello<｜Assistant｜>Hi there!", "Числа 1234567 и 中文。", "plain text\n\n"]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "out"
    cfg = load_config({"input": {"path": str(corpus)}, "output_dir": str(out), "stages": ["tokenize_pack"],
                       "tokenizer": {"spec": "deepseek_v3", "vocab_size": 128000, "padded_vocab_size": 129280,
                                     "path": str(release)}})
    run(cfg)
    tokens = PackedTokens(out / "shards")
    assert tokens.meta["dtype"] == "uint32" and tokens.meta["padded_vocab_size"] == 129280
    stream = tokens.window(0, len(tokens)).astype(np.int64)
    tokenizer = Tokenizer.from_file(str(release / TOKENIZER_FILE))
    expected = [i for t in texts for i in tokenizer.encode(t, add_special_tokens=False).ids + [1]]
    assert stream.tolist() == expected and 128803 in expected
    copied = out / "tokenizer"
    assert (copied / TOKENIZER_FILE).read_bytes() == (release / TOKENIZER_FILE).read_bytes()
    meta = json.loads((copied / "meta.json").read_text())
    assert (meta["vocab_size"], meta["eos_id"], meta["source"]) == (128815, 1, str(release.resolve()))
    with pytest.raises(ConfigError, match="drop train_tokenizer"):
        run(load_config({"input": {"path": str(corpus)}, "output_dir": str(tmp_path / "out2"),
                         "stages": ["train_tokenizer", "tokenize_pack"], "tokenizer": {"path": str(release)}}))


def test_pretraining_data_packs_with_data_tokenizer_dir(trained, tmp_path):
    """``data.tokenizer_dir``: the data module packs the corpus with a released tokenizer (no meta.json)
    through the pipeline's ``tokenize_pack`` alone, and serves its ids; another tokenizer is stale."""
    from dsl_lit.config import TrainConfig
    from dsl_lit.data.cache import stale_reason
    from dsl_lit.data.datamodule import PretrainDataModule
    from dsl_lit.training.runs import check_vocab
    from tests.conftest import compose_config

    release = _release_dir(trained["deepseek_v3"], tmp_path / "DeepSeek-V3", 129280)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [f"Document {i}: Привет, 世界! " * 20 for i in range(40)]
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    overrides = [f"data.corpus_dir={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"data.tokenizer_dir={release}",
                 "data.seq_len=32", "data.global_batch_size=4", "data.micro_batch_size=2"]
    small = TrainConfig.from_hydra(compose_config("pretrain", overrides))
    with pytest.raises(ConfigError, match=r"128815 token ids but model\.vocab_size=\d+"):
        check_vocab(small, PretrainDataModule(small.data))  # refused before anything is packed
    assert not (tmp_path / "cache").exists()
    cfg = TrainConfig.from_hydra(compose_config("pretrain", [*overrides, "+model.vocab_size=129280"]))
    datamodule = PretrainDataModule(cfg.data)
    check_vocab(cfg, datamodule)
    datamodule.setup("fit")
    assert datamodule.tokens.meta["dtype"] == "uint32" and datamodule.tokenizer_meta["padded_vocab_size"] == 129280
    tokenizer = Tokenizer.from_file(str(release / TOKENIZER_FILE))
    stream = datamodule.tokens.window(0, len(datamodule.tokens)).tolist()
    assert stream[: stream.index(1) + 1] == tokenizer.encode(texts[0], add_special_tokens=False).ids + [1]
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["input_ids"].shape == (4, 32) and int(batch["input_ids"].max()) < 128815
    assert stale_reason(cfg.data) is None
    other = _release_dir(trained["deepseek_llm"], tmp_path / "deepseek-llm", None)
    assert "not the one in data.tokenizer_dir" in stale_reason(TrainConfig.from_hydra(compose_config(
        "pretrain", [*overrides[:2], f"data.tokenizer_dir={other}"])).data)
    assert "set data.tokenizer_dir" in stale_reason(TrainConfig.from_hydra(compose_config("pretrain", overrides[:2])).data)
