"""Downstream evaluation with lm-evaluation-harness (issue 21).

Fast: our LM class against direct forwards of the same model (loglikelihoods, rolling
loglikelihoods, stop sequences; batching changes nothing), task YAMLs whose data paths are
relative to the YAML load from any working directory, the bundled data is what its generator
makes, config errors. Slow: on a checkpoint of the real pretrain recipe, exported with
recipes/export_hf.py, recipes/evaluate.py's numbers equal lm-eval's own ``hf`` backend
(``AutoModelForCausalLM`` on the export) request by request; in-loop evaluation under dp=2 and
pp=2 equals evaluating that step's checkpoint, and under pp=2 expert load reports every stage.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from tokenizers import Tokenizer

from data_contract.errors import ConfigError
from data_contract.schema import dataclass_from_dict
from dsl_lit.config import TrainConfig
from dsl_lit.config.eval import EvalConfig, EvalTasksConfig, PasskeyProbeConfig
from dsl_lit.config.evaluate import EvaluateConfig
from dsl_lit.data.datamodule import PretrainDataModule
from dsl_lit.evaluation import bundled
from dsl_lit.evaluation.checkpoint import evaluate_checkpoint
from dsl_lit.evaluation.harness import Harness, flat_metrics
from dsl_lit.evaluation.lm import DslLitLM
from dsl_lit.evaluation.passkey import passkey_outcomes
from dsl_lit.evaluation.source import load_eval_model
from dsl_lit.evaluation.tokenizer import EvalTokenizer
from dsl_lit.inference.generation import generate
from dsl_lit.models import ModelConfig, build_model
from tests.conftest import ROOT, compose_config
from tests.forked_python import run_python

TINY = dict(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=256, init_std=0.1)
"""A random model with peaked predictions (init_std 0.1): greedy choices are not near-ties, so
batched and unbatched runs pick the same tokens despite last-bit differences."""
TEXT = "And God said, Let there be light: and there was light. And God saw the light, that it was good."


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    """The bundled corpus's tokenizer (the recipes' default), built into .cache/ on first use."""
    datamodule = PretrainDataModule(TrainConfig.from_hydra(compose_config()).data)
    datamodule.prepare_data()
    return datamodule.tokenizer_dir


@pytest.fixture(scope="module")
def lm(tokenizer_dir: Path) -> DslLitLM:
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny", **TINY)).eval()
    return DslLitLM(model, EvalTokenizer.from_dir(tokenizer_dir), batch_size=4)


def _request(kind: str, *arguments: object, idx: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=tuple(arguments), idx=idx)


@torch.no_grad()
def _logprobs(lm: DslLitLM, tokens: list[int]) -> torch.Tensor:
    """Log-probs of tokens[1:] given their prefixes, from one plain forward of the whole sequence."""
    logits = lm.model(torch.tensor([tokens])).float()[0, :-1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)


def test_loglikelihood_equals_a_direct_forward_whatever_the_batching(lm: DslLitLM) -> None:
    pairs = [("And God said,", " Let there be light"), ("In the beginning", " God created"),
             ("The earth was", " without form"), ("The earth was", " void"), ("", "Darkness was upon the deep")]
    results = lm.loglikelihood([_request("loglikelihood", c, x, idx=i) for i, (c, x) in enumerate(pairs)])
    lm.batch_size = 1
    one_by_one = lm.loglikelihood([_request("loglikelihood", c, x) for c, x in pairs])
    lm.batch_size = 4
    for (context, continuation), (score, _), (single, _) in zip(pairs, results, one_by_one):
        context_ids = lm.tok_encode(context) if context else [lm.prefix_token_id]
        whole = lm.tok_encode(context + continuation) if context else context_ids + lm.tok_encode(continuation)
        expected = _logprobs(lm, whole)[len(context_ids) - 1:].sum().item()
        # fp32 sums of a few tens of log-probs of magnitude ~10: a few ulps of the sum apart
        assert math.isclose(score, expected, rel_tol=1e-6), (context, score, expected)
        assert math.isclose(score, single, rel_tol=1e-6)


def test_is_greedy_and_one_token_continuations_sharing_a_context(lm: DslLitLM) -> None:
    context = lm.tok_encode("And God said,")
    greedy = generate(lm.model, [context], 3).completions[0]
    other = [(greedy[0] + 1) % lm.model.config.vocab_size]
    requests = [(None, context, greedy), (None, context, greedy[:1]), (None, context, other)]
    (full, full_greedy), (first, first_greedy), (wrong, wrong_greedy) = lm._loglikelihood_tokens(requests)
    assert full_greedy and first_greedy and not wrong_greedy
    step = _logprobs(lm, context + greedy)[len(context) - 1:]
    assert math.isclose(full, step.sum().item(), rel_tol=1e-6) and math.isclose(first, step[0].item(), rel_tol=1e-6)


def test_rolling_loglikelihood_scores_every_token_once(lm: DslLitLM) -> None:
    tokens = lm.tok_encode(TEXT)
    (whole,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", TEXT)])
    expected = _logprobs(lm, [lm.prefix_token_id, *tokens]).sum().item()
    assert math.isclose(whole, expected, rel_tol=1e-6)
    # windows of 8 tokens: less context for most tokens, so a different but finite total; each
    # window's first prediction has one token of context less than the model could use
    short = DslLitLM(lm.model, lm.eval_tokenizer, batch_size=3, max_length=8)
    (windowed,) = short.loglikelihood_rolling([_request("loglikelihood_rolling", TEXT)])
    first = _logprobs(lm, [lm.prefix_token_id, *tokens[:8]]).sum().item()
    assert len(tokens) > 16 and math.isfinite(windowed) and windowed != whole
    assert windowed < first  # the later windows add their tokens' (negative) log-probs


def test_generate_until_stops_at_the_stop_sequence(lm: DslLitLM) -> None:
    prompts = ["And God said,", "In the beginning God created the heaven", "The"]
    completions = generate(lm.model, [lm.tok_encode(p) for p in prompts], 6).completions
    texts = [lm.tok_decode(c) for c in completions]
    stop = lm.tok_decode(completions[1][2:4])  # text in the middle of the second completion
    kwargs = {"until": [stop], "max_gen_toks": 6, "do_sample": False}
    outputs = lm.generate_until([_request("generate_until", p, kwargs, idx=i) for i, p in enumerate(prompts)])
    assert outputs == [t.split(stop)[0] for t in texts] and len(outputs[1]) < len(texts[1])
    lm.batch_size = 1
    assert lm.generate_until([_request("generate_until", p, kwargs) for p in prompts]) == outputs
    lm.batch_size = 4


def test_bundled_data_is_what_its_generator_makes() -> None:
    for name, records in bundled.bundled_files().items():
        assert (bundled.BUNDLED_TASKS_DIR / name).read_text(encoding="utf-8") == bundled.to_jsonl(records), name
    docs = bundled.kjv_next_sentence()
    assert len(docs) == 128 and all(len(set(d["choices"])) == 4 and 0 <= d["label"] < 4 for d in docs)
    assert {d["label"] for d in docs} == {0, 1, 2, 3}  # the answer's position is shuffled
    fewshot, test = bundled.arithmetic_docs()
    assert not {p["question"] for p in fewshot} & {p["question"] for p in test}


def _task_dir(root: Path, data_files: str) -> Path:
    """A user's task directory: a YAML with relative data_files, an included base YAML one level
    up, and a ``!function`` helper beside it that reads a file beside itself."""
    (root / "tasks" / "data").mkdir(parents=True)
    (root / "base.yaml").write_text("output_type: multiple_choice\ntest_split: test\n")
    (root / "tasks" / "data" / "docs.jsonl").write_text(
        "".join(json.dumps({"q": f"{a} + {a}", "choices": [str(a), str(2 * a)], "label": 1}) + "\n" for a in range(6)))
    (root / "tasks" / "suffix.txt").write_text(" =")
    (root / "tasks" / "helpers.py").write_text(
        "from pathlib import Path\n"
        "SUFFIX = (Path(__file__).parent / 'suffix.txt').read_text()\n"
        "def text(doc):\n    return doc['q'] + SUFFIX\n")
    (root / "tasks" / "my_task.yaml").write_text(
        "include: ../base.yaml\ntask: my_task\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data_files}\n"
        "doc_to_text: !function helpers.text\ndoc_to_target: label\ndoc_to_choice: choices\n")
    return root / "tasks"


def test_task_yaml_data_paths_resolve_from_any_directory(tmp_path: Path, monkeypatch, lm: DslLitLM) -> None:
    tasks = _task_dir(tmp_path / "user", "data/docs.jsonl")
    monkeypatch.chdir(tmp_path)  # neither the tasks' directory nor the project
    cfg = EvalTasksConfig(tasks=["my_task"], include_path=[str(tasks)], limit=4)
    with Harness(cfg) as harness:
        task = harness.task_manager.load(["my_task"])["tasks"]["my_task"]
        docs = list(task.test_docs())
        assert len(docs) == 6 and task.doc_to_text(docs[1]) == "1 + 1 ="
        results = harness.evaluate(lm)
    assert results["results"]["my_task"]["sample_len"] == 4
    assert set(flat_metrics(results)) == {"eval/my_task/acc", "eval/my_task/acc_norm"}  # multiple choice defaults


def test_bad_task_inputs_are_config_errors(tmp_path: Path) -> None:
    tasks = _task_dir(tmp_path, "data/missing.jsonl")
    with pytest.raises(ConfigError, match=r"my_task.yaml: dataset_kwargs.data_files='data/missing.jsonl' exists"):
        Harness(EvalTasksConfig(tasks=["my_task"], include_path=[str(tasks)]))
    with pytest.raises(ConfigError, match="'dsl_arithmetc' is not among the tasks.*did you mean dsl_arithmetic"):
        Harness(EvalTasksConfig(tasks=["dsl_arithmetc"]))
    with pytest.raises(ConfigError, match="include_path: .* is not a directory"):
        Harness(EvalTasksConfig(tasks=["dsl_arithmetic"], include_path=[str(tmp_path / "nowhere")]))


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"eval.every_n_steps=5 but eval.tasks is empty"):
        EvalConfig(every_n_steps=5, tokenizer_dir="x").validate()
    with pytest.raises(ConfigError, match=r"eval.limit=0 must be > 0"):
        EvalConfig(limit=0).validate()
    with pytest.raises(ConfigError, match=r"^checkpoint= is required"):
        EvaluateConfig(tasks=["dsl_arithmetic"]).validate()
    with pytest.raises(ConfigError, match=r"^precision='fp8' is unknown"):
        dataclass_from_dict(EvaluateConfig, {"checkpoint": "x", "tasks": ["a"], "precision": "fp8"}, "evaluate")
    with pytest.raises(ConfigError, match=r"^batch_size=0 must be >= 1"):
        EvaluateConfig(checkpoint="x", tasks=["a"], batch_size=0).validate()
    cfg = TrainConfig.from_hydra(compose_config(overrides=["eval=bundled"]))
    assert cfg.eval.every_n_steps == 100 and cfg.eval.tasks == list(bundled.BUNDLED_TASKS)
    assert cfg.eval.tokenizer_dir == str(Path(cfg.data.cache_dir) / "tokenizer")


# -- slow: the recipes end to end ------------------------------------------------------------------


def _run(script: str, *overrides: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A recipe in a subprocess, started from ``cwd`` (this checkout's code whatever the directory)."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    result = run_python([sys.executable, str(ROOT / "recipes" / script), *overrides], cwd=cwd, timeout=900,
                        env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _compare_samples(ours: dict, reference: dict, tasks: list[str]) -> None:
    """Every request's response: loglikelihood sums within fp32 reordering of the sum (rel 1e-6,
    ~8 ulps), greedy flags and generated strings identical."""
    for task in tasks:
        mine, theirs = ours["samples"][task], reference["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs] and mine
        for a, b in zip(mine, theirs):
            for (x,), (y,) in zip(a["resps"], b["resps"]):
                if isinstance(x, str):  # a generation
                    assert x == y, (task, a["doc_id"])
                elif isinstance(x, float):  # a rolling loglikelihood
                    assert math.isclose(x, y, rel_tol=1e-6), (task, a["doc_id"], x, y)
                else:  # (loglikelihood, is_greedy)
                    assert math.isclose(x[0], y[0], rel_tol=1e-6) and x[1] == y[1], (task, a["doc_id"], x, y)


@pytest.mark.slow
def test_evaluate_recipe_matches_lm_evals_hf_backend(tmp_path: Path, tokenizer_dir: Path) -> None:
    from lm_eval import simple_evaluate

    run, export = tmp_path / "run", tmp_path / "hf"
    # init_std 0.1 (TINY's reason): greedy generations are varied text, where a briefly trained tiny
    # model repeats " the", and top-2 gaps stay far above the two implementations' fp32 differences
    _run("pretrain.py", "model=deepseek_llm_tiny", "+model.n_layers=2", "++model.init_std=0.1", "data.seq_len=64",
         "data.global_batch_size=8", "data.micro_batch_size=8", "optim.lr=1e-4", "trainer.max_steps=2",
         "checkpoint.every_n_steps=2", "logger=csv", "trainer.progress_bar=false", f"hydra.run.dir={run}")
    _run("export_hf.py", f"checkpoint={run}", f"output={export}")  # with the tokenizer's bos/eos/pad ids
    tokenizer = EvalTokenizer.from_dir(tokenizer_dir)

    tasks = list(bundled.BUNDLED_TASKS)  # multiple choice, rolling loglikelihood, generate_until
    out = tmp_path / "eval"
    _run("evaluate.py", f"checkpoint={run}", "limit=16", "batch_size=5", "bootstrap_iters=0", "log_samples=true",
         "wandb.enabled=true", f"hydra.run.dir={out}", cwd=tmp_path)
    ours = json.loads((out / "results.json").read_text())
    assert list(out.glob("wandb/offline-run-*/files/results.json"))
    assert ours["config"]["global_step"] == 2 and ours["config"]["format"] == "dsl_lit"
    ours["samples"] = {t: [json.loads(line) for line in (out / f"samples_{t}.jsonl").read_text().splitlines()]
                       for t in tasks}

    cfg = EvalTasksConfig(tasks=tasks, limit=16, bootstrap_iters=0, log_samples=True)
    with Harness(cfg) as harness:
        def hf(names: list[str], **args: object) -> dict:
            return simple_evaluate(model="hf", model_args=dict(pretrained=str(export), tokenizer=str(tokenizer_dir),
                                                               dtype="float32", device="cpu", **args),
                                   batch_size=4, tasks=names, limit=16, bootstrap_iters=0, log_samples=True,
                                   task_manager=harness.task_manager)

        reference = hf(tasks)
        # Windows of 48 tokens, both sides: several rolling windows per document, and few-shot
        # prompts cut from the left to leave room for the answer (the choices do not fit in 48)
        short_tasks = ["dsl_devil_perplexity", "dsl_arithmetic"]
        short_reference = hf(short_tasks, max_length=48)
        harness.cfg.tasks = short_tasks
        short = harness.evaluate(DslLitLM(load_eval_model(run).model, tokenizer, batch_size=3, max_length=48))
    _compare_samples(ours, reference, tasks)
    _compare_samples(short, short_reference, short_tasks)
    # the export itself as the source (it carries the run's tokenizer files): the same numbers
    hf_dir = EvaluateConfig(checkpoint=str(export), tasks=["dsl_devil_perplexity"], limit=16, bootstrap_iters=0)
    from_export = evaluate_checkpoint(hf_dir, tmp_path / "hf_eval")["results"]["dsl_devil_perplexity"]
    assert from_export["bits_per_byte,none"] == pytest.approx(ours["results"]["dsl_devil_perplexity"]["bits_per_byte,none"],
                                                              rel=1e-6)
    generated = [s["resps"][0][0] for s in ours["samples"]["dsl_arithmetic"]]
    assert len(set(generated)) > 8  # varied text was generated and compared
    for task in tasks:
        for key, value in reference["results"][task].items():
            if isinstance(value, float):
                assert math.isclose(ours["results"][task][key], value, rel_tol=1e-5), (task, key)


def _eval_rows(run: Path) -> dict[str, float]:
    """The eval/ scalars metrics.csv holds (one evaluation: lm-eval's row and the passkey probe's, at one step)."""
    with (run / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if any(k.startswith("eval/") and v for k, v in r.items())]
    assert len({r["step"] for r in rows}) == 1, rows
    return {k: float(v) for r in rows for k, v in r.items() if k.startswith("eval/") and k != "eval/time_s" and v}


IN_LOOP = ["model=deepseek_v3_tiny", "++model.n_layers=4", "data.seq_len=64", "data.global_batch_size=8",
           "data.micro_batch_size=2", "trainer.max_steps=2", "checkpoint.every_n_steps=2", "logger=csv",
           "trainer.progress_bar=false", "trainer.log_every_n_steps=1", "trainer.accelerator=cpu",
           "eval.every_n_steps=2", "eval.limit=10", "eval.batch_size=4",
           "eval.tasks=[dsl_kjv_next_sentence,dsl_devil_perplexity,dsl_arithmetic]",
           "eval.passkey.every_n_steps=2", "eval.passkey.per_depth=2"]  # and the passkey probe, at data.seq_len


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["trainer.devices=2"], ["trainer.devices=2", "parallel=pp_1f1b"]],
                         ids=["dp2", "pp2"])
def test_in_loop_evaluation_equals_evaluating_the_checkpoint(tmp_path: Path, layout: list[str]) -> None:
    run = tmp_path / "run"
    _run("pretrain.py", *IN_LOOP, *layout, f"hydra.run.dir={run}")
    logged = _eval_rows(run)
    probed = logged.pop("eval/passkey/64")  # the probe ran on every rank (a gathered copy under pp) and stopped none
    results = json.loads((run / "eval" / "step-2" / "results.json").read_text())
    assert flat_metrics(results) == pytest.approx(logged, rel=1e-12)  # what rank 0 wrote is what it logged
    assert {r["sample_len"] for r in results["results"].values()} == {10}  # both ranks' documents, gathered

    cfg = dataclass_from_dict(EvalTasksConfig, {"tasks": list(bundled.BUNDLED_TASKS), "limit": 10}, "eval")
    source = load_eval_model(run / "checkpoints" / "step-2")
    with Harness(cfg) as harness:
        alone = flat_metrics(harness.evaluate(DslLitLM(source.model, EvalTokenizer.from_dir(source.tokenizer_dir))))
    outcomes = passkey_outcomes(source.model, Tokenizer.from_file(str(Path(source.tokenizer_dir) / "tokenizer.json")),
                                [64], PasskeyProbeConfig().depths, per_depth=2, seed=PasskeyProbeConfig().seed)
    assert probed == sum(sum(hits) for hits in outcomes[64].values()) / 10
    assert alone.keys() == logged.keys()
    for key, value in alone.items():  # other batches and another split of the documents: fp32 reordering
        assert logged[key] == pytest.approx(value, rel=1e-5), key

    with (run / "metrics.csv").open() as f:
        header = next(csv.reader(f))
    # expert load from every pipeline stage's MoE layers (under pp=2 rank 0 holds layers 0-1 only)
    for layer in ("layers.1", "layers.2", "layers.3", "mtp.0"):
        assert f"moe/load_max_over_mean/{layer}" in header


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek_v32_tiny", "deepseek_v4_tiny"])
def test_the_newest_families_score_as_lm_evals_hf_backend_scores_their_export(tmp_path: Path, tokenizer_dir: Path,
                                                                               preset: str) -> None:
    """DeepSeek-V3.2 (the indexer's top-k keys) and V4 (mHC streams, compressed windows) through our
    lm-eval model and through lm-eval's own ``hf`` backend on the hub export (transformers 5.24's
    classes): every multiple-choice and rolling loglikelihood equal within fp32 reordering, the same
    greedy flags; ours batched, lm-eval's one request at a time (transformers' DeepseekV32 scores a
    right-padded batch of 4 differently from its rows alone: measured -355.98 against -355.53 on the
    first document, where ours gives -355.53 batched or not). Eight index heads: with the presets' four, some
    keys score exactly 0 for every head (all ReLUs zero) and ties at the k-th place are broken by
    ``torch.topk`` by where a key lies in the row, so a right-padded batch may pick other tied keys
    than the row alone, in transformers' indexer as in ours (measured: log-likelihood sums 3e-4 to
    7e-4 apart; the released configs' 64 heads make such ties vanishingly rare). (Generation: the
    families' greedy parity tests, tests/unit/models/.)"""
    from lm_eval import simple_evaluate

    from dsl_lit.hf import save_pretrained

    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name(preset, init_std=0.1, index_n_heads=8)).eval()
    save_pretrained(model, tmp_path / "hf")
    tasks = ["dsl_kjv_next_sentence", "dsl_devil_perplexity"]
    cfg = EvalTasksConfig(tasks=tasks, limit=6, bootstrap_iters=0, log_samples=True)
    with Harness(cfg) as harness:
        ours = harness.evaluate(DslLitLM(model, EvalTokenizer.from_dir(tokenizer_dir), batch_size=3))
        reference = simple_evaluate(model="hf", model_args=dict(pretrained=str(tmp_path / "hf"), tokenizer=str(tokenizer_dir),
                                                                dtype="float32", device="cpu", attn_implementation="eager"),
                                    batch_size=1, tasks=tasks, limit=6, bootstrap_iters=0, log_samples=True,
                                    task_manager=harness.task_manager)
    _compare_samples(ours, reference, tasks)
