"""SFT data and objective: the chat template and prompt masking, packing isolation (a packed row
computes what its conversations compute alone), and the real recipe end to end (its checkpoint then
starts DPO in tests/unit/posttrain/test_dpo.py's style)."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from data_contract.errors import ConfigError
from data_contract.format import ASSISTANT_TOKEN, USER_TOKEN
from data_pipeline.io.sources import load_documents
from data_pipeline.tokenizer.training import tokenizer_spec, train_tokenizer
from dsl_lit.config import TrainConfig
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.posttrain import GRPOConfig, TaskConfig
from dsl_lit.data.datamodule import PretrainDataModule
from dsl_lit.models import ModelConfig
from dsl_lit.ops import cross_entropy
from dsl_lit.posttrain import SFTModule
from dsl_lit.posttrain.chat.conversations import task_conversations
from dsl_lit.posttrain.chat.rows import IGNORE, document, packed_rows, padded_rows, sft_rows
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.tasks.arithmetic import problems
from tests.conftest import ROOT, compose_config, scratch_dir
from tests.forked_python import run_python
from tests.numerics import assert_close_fp32


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    """The bundled corpus's tokenizer (the recipes' default), built in the session's data cache on first use."""
    datamodule = PretrainDataModule(TrainConfig.from_hydra(compose_config()).data)
    datamodule.prepare_data()
    return ChatTokenizer.from_dir(datamodule.tokenizer_dir)


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>2 + 3 = 5</think><answer>5</answer>"},
    {"role": "user", "content": "And times 2?"},
    {"role": "assistant", "content": "<think>5 * 2 = 10</think><answer>10</answer>"},
]


def test_chat_template_and_prompt_masking(tokenizer):
    """The bundled tokenizer has no template of its own: DeepSeek's format, turn by turn."""
    assert not tokenizer.has_own_template
    encoded = tokenizer.encode_conversation(CONVERSATION)
    ids, trained = encoded.ids, encoded.trained
    user, assistant = (tokenizer.tokenizer.token_to_id(t) for t in (USER_TOKEN, ASSISTANT_TOKEN))
    text = tokenizer.encode_text
    assert ids == ([tokenizer.bos_id] + text("You are terse.") + [user] + text("What is 2 + 3?") + [assistant]
                   + text(CONVERSATION[2]["content"]) + [tokenizer.eos_id] + [user] + text("And times 2?")
                   + [assistant] + text(CONVERSATION[4]["content"]) + [tokenizer.eos_id])
    # R1's tags are single special tokens
    think = tokenizer.tokenizer.token_to_id("<think>")
    assert ids.count(think) == 2 and think in tokenizer.encode_text("<think>")
    # exactly the assistant replies (each with its end-of-sentence) are trained on
    trained_text = tokenizer.tokenizer.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False)
    assert trained_text == ("<think>2 + 3 = 5</think><answer>5</answer><｜end▁of▁sentence｜>"
                            "<think>5 * 2 = 10</think><answer>10</answer><｜end▁of▁sentence｜>")
    # next-token labels: -100 wherever the target is not the assistant's
    inputs, labels = document(encoded, seq_len=512)
    assert inputs == ids[:-1] and len(labels) == len(inputs)
    assert [t for t in labels if t != IGNORE] == [i for i, t in zip(ids[1:], trained[1:]) if t]
    assert labels[ids.index(assistant) - 1] == IGNORE  # the user's turn is masked
    prompt = tokenizer.encode_prompt(CONVERSATION[:2])
    assert prompt[-1] == assistant and ids[: len(prompt)] == prompt
    with pytest.raises(ValueError, match="role"):
        tokenizer.encode_conversation([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="message 1 has role system"):
        tokenizer.encode_conversation([CONVERSATION[1], CONVERSATION[0]])


def test_packing_layout():
    docs = [([1, 2, 3], [2, 3, IGNORE]), ([4, 5], [IGNORE, 6]), ([7, 8, 9, 10], [8, 9, 10, 11])]
    rows = packed_rows(docs, seq_len=6, pad_id=0)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0], [7, 8, 9, 10, 0, 0]]
    assert rows["positions"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert rows["doc_ids"].tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, -1, -1]]
    assert rows["labels"].tolist() == [[2, 3, IGNORE, IGNORE, 6, IGNORE], [8, 9, 10, 11, IGNORE, IGNORE]]
    padded = padded_rows(docs, seq_len=6, pad_id=0)
    assert set(padded) == {"input_ids", "labels"} and padded["input_ids"].shape == (3, 6)


def _module(family: str) -> SFTModule:
    cfg = {"deepseek_llm": lambda: ModelConfig.from_name("deepseek_llm_tiny", n_layers=2),
           "deepseek_v3": lambda: ModelConfig.from_name("deepseek_v3_tiny", n_layers=2, mtp_depth=0),
           # every kind of layer; eight index heads keep its scores free of ties at the k-th (all ReLUs
           # zero), which torch.topk breaks by where a window lies in the row
           "deepseek_v4": lambda: ModelConfig.from_name("deepseek_v4_tiny", index_n_heads=8)}[family]()
    module = SFTModule(cfg, OptimConfig(), ScheduleConfig(name="constant", warmup_steps=0), micro_batch_size=4,
                       total_steps=1)
    module.configure_model()
    return module.eval()


@pytest.mark.parametrize("family", ["deepseek_llm", "deepseek_v3", "deepseek_v4"])
def test_packed_batch_gives_the_same_loss_as_the_sequences_alone(tokenizer, family):
    torch.manual_seed(0)
    module = _module(family)
    conversations = [tokenizer.encode_conversation(c) for c in task_conversations(TaskConfig(num_problems=40))[:5]]
    conversations.append(tokenizer.encode_conversation(CONVERSATION))
    packed = sft_rows(conversations, seq_len=256, pad_id=tokenizer.pad_id, packing=True)
    assert packed["input_ids"].shape[0] == 1 and packed["doc_ids"].max() == 5  # all six in one row
    alone = sft_rows(conversations, seq_len=256, pad_id=tokenizer.pad_id, packing=False)
    with torch.no_grad():
        packed_losses = cross_entropy(module.logits(packed), packed["labels"], reduction="none")
        alone_losses = cross_entropy(module.logits(alone), alone["labels"], reduction="none")
    # per target token, in order: the same values
    p, a = packed_losses[packed["labels"].flatten() != IGNORE], alone_losses[alone["labels"].flatten() != IGNORE]
    assert p.shape == a.shape and p.numel() > 50
    cfg = module.model_config  # attention over up to 256 positions in another layout, per layer
    assert_close_fp32(p, a, cfg.d_model * cfg.n_layers * 256)
    # and the document mask is what makes it so: without it the later conversations see the earlier ones
    leaky = {k: v for k, v in packed.items() if k != "doc_ids"}
    with torch.no_grad():
        leaked = cross_entropy(module.logits(leaky), packed["labels"], reduction="none")
    assert (leaked[packed["labels"].flatten() != IGNORE] - p).abs().max() > 1e-3


def test_generated_task_is_deterministic_and_valid():
    cfg = TaskConfig(num_problems=50, max_operand=9, operations=["+", "*"], seed=3)
    first, second = problems(cfg), problems(cfg)
    assert first == second and len({p["question"] for p in first}) == 50
    for p in first:
        a, op, b = p["question"].split()
        assert int(p["answer"]) == (int(a) + int(b) if op == "+" else int(a) * int(b))


def test_largest_problems_their_count_and_a_cold_start_with_shortcuts():
    cfg = TaskConfig(num_problems=300, max_operand=9, operations=["largest", "+"], list_length=5, seed=1)
    kinds = {"largest": 0, "+": 0}
    for p in problems(cfg):
        if p["question"].startswith("the largest of "):
            numbers = [int(n) for n in p["question"].removeprefix("the largest of ").split()]
            assert len(numbers) == 5 and p["answer"] == str(max(numbers))
            kinds["largest"] += 1
        else:
            kinds["+"] += 1
    assert min(kinds.values()) > 50
    assert TaskConfig(max_operand=9, operations=["largest", "+"], list_length=5).available() == 10**5 + 100
    # adding an operation leaves the draws of the others as they were
    binary = TaskConfig(num_problems=50, max_operand=9, operations=["+", "*"], seed=3)
    assert [p["question"] for p in problems(binary)[:3]] == ["3 + 9", "5 * 9", "9 + 1"]  # as drawn before largest existed
    # an imperfect cold start: a share of the replies answer with the question's last number
    task = TaskConfig(num_problems=400, eval_problems=0, max_operand=9, operations=["largest"])
    right = task_conversations(task)
    assert right == task_conversations(task, shortcut_share=0.0)
    mixed = task_conversations(task, shortcut_share=0.6)
    assert mixed == task_conversations(task, shortcut_share=0.6)  # drawn from the task's seed
    answers = [(p["answer"], p["question"].split()[-1], c[1]["content"]) for p, c in zip(problems(task), mixed)]
    differs = [(a, last, reply) for a, last, reply in answers if a != last]
    shortcut = sum(reply.endswith(f"<answer>{last}</answer>") for _, last, reply in differs)
    assert all(reply.endswith(f"<answer>{a}</answer>") or reply.endswith(f"<answer>{last}</answer>")
               for a, last, reply in differs)
    assert 0.5 < shortcut / len(differs) < 0.7, shortcut / len(differs)
    with pytest.raises(ConfigError, match=r"grpo.cold_start_shortcut=1.0 must be in \[0, 1\)"):
        GRPOConfig(cold_start_shortcut=1.0).validate()
    with pytest.raises(ConfigError, match=r"task.list_length=1 must be >= 2"):
        TaskConfig(operations=["largest"], list_length=1).validate()
    with pytest.raises(ConfigError, match=r"task.num_problems=101 must be in \[1, 100\]"):
        TaskConfig(operations=["largest"], max_operand=9, list_length=2, num_problems=101).validate()


def test_uniform_largest_lists_leave_no_constant_answer_that_wins():
    """Every digit uniform: "9" is the largest of ~34% of lists of four (1 - 0.9^4), the constant a
    policy rewarded on accuracy drifted to; drawn around a uniform largest, no answer comes near."""
    from collections import Counter

    plain = TaskConfig(num_problems=2300, eval_problems=400, max_operand=9, operations=["largest"])
    uniform = TaskConfig(**{**plain.__dict__, "uniform_largest": True})
    for cfg, lowest, highest in ((plain, 0.30, 0.40), (uniform, 0.05, 0.25)):
        drawn = problems(cfg)
        assert len({p["question"] for p in drawn}) == 2300
        for p in drawn:
            numbers = [int(n) for n in p["question"].removeprefix("the largest of ").split()]
            assert len(numbers) == 4 and p["answer"] == str(max(numbers))
        share = Counter(p["answer"] for p in drawn).most_common(1)[0][1] / len(drawn)
        assert lowest < share < highest, (cfg.uniform_largest, share)
    # the default draws as before the option (the reproductions' earlier held-out lists)
    assert [p["question"] for p in problems(plain)[:2]] == ["the largest of 6 6 4 8", "the largest of 7 6 7 5"]


# -- released tokenizers: their own chat template ---------------------------------------------------

DEEPSEEK_LLM_CHAT = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                     "{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}"
                     "{{ 'Assistant: ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
"""A template whose generation prompt stops before the space the reply starts with (DeepSeek LLM
chat's shape): the reply's first token straddles the boundary and is the assistant's."""

DROPS_EARLIER_REASONING = ("{{ bos_token }}{% for message in messages %}{% set content = message['content'] %}"
                           "{% if message['role'] == 'user' %}{{ '<｜User｜>' + content }}"
                           "{% elif message['role'] == 'assistant' %}{% if not loop.last and '</think>' in content %}"
                           "{% set content = content.split('</think>')[-1] %}{% endif %}"
                           "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
                           "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{% endif %}")
"""R1's convention: the reasoning of earlier assistant turns is not shown to later ones."""

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "system", "content": "Answer in English."},
    {"role": "user", "content": "What is 12 * 13?"},
    {"role": "assistant", "content": "<think>12 * 13 = 156</think>It is 156."},
    {"role": "user", "content": "Und auf Deutsch? 中文呢？"},
    {"role": "assistant", "content": "<think>\nTranslate.\n</think>\n\nHundertsechsundfünfzig: 一百五十六。"},
]


@pytest.fixture(scope="module")
def v3_dir(request: pytest.FixtureRequest) -> Path:
    """A tokenizer with DeepSeek-V3's released spec (600 learned tokens), shaped like a model
    repository's: tokenizer.json and tokenizer_config.json with V3's chat template, no meta.json."""
    texts = load_documents(sorted((ROOT / "data" / "corpus").glob("*.jsonl.gz")),
                           cache_dir=scratch_dir(request, "hf"))["text"]
    trained = train_tokenizer(texts, 600, scratch_dir(request, "v3") / "tok", spec=tokenizer_spec("deepseek_v3"),
                              max_bytes=300_000)
    release = scratch_dir(request, "release")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(trained / name, release / name)
    return release


def _with_template(v3_dir: Path, tmp_path: Path, template: str) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(v3_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return tmp_path


def _check_against_transformers(directory: Path, conversation: list[dict], trained_text: str) -> None:
    """Our ids are transformers' apply_chat_template ids, and exactly ``trained_text`` is trained on."""
    from transformers import AutoTokenizer

    ours, theirs = ChatTokenizer.from_dir(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.has_own_template
    encoded = ours.encode_conversation(conversation)
    assert encoded.ids == list(theirs.apply_chat_template(conversation, tokenize=True, return_dict=False))
    trained = [i for i, t in zip(encoded.ids, encoded.trained) if t]
    assert ours.tokenizer.decode(trained, skip_special_tokens=False) == trained_text
    prompt = conversation[: max(i for i, m in enumerate(conversation) if m["role"] == "user") + 1]
    expected = theirs.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.encode_prompt(prompt) == list(expected)


def test_v3_chat_template_rows_equal_transformers(v3_dir):
    eos = "<｜end▁of▁sentence｜>"
    _check_against_transformers(v3_dir, MULTI_TURN, MULTI_TURN[3]["content"] + eos + MULTI_TURN[5]["content"] + eos)
    single = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    _check_against_transformers(v3_dir, single, "Hello!" + eos)
    tokenizer = ChatTokenizer.from_dir(v3_dir)
    ids = tokenizer.encode_conversation(single).ids
    assert ids[0] == 0 and ids[-1] == tokenizer.eos_id == tokenizer.pad_id == 1  # V3: pad is the eos
    assert 128803 in ids and 128804 in ids  # <｜User｜>, <｜Assistant｜>: one id each
    assert tokenizer.vocab_size == 128815
    # the task's R1-format replies keep their reasoning under V3's template
    rows = sft_rows([tokenizer.encode_conversation(c) for c in task_conversations(TaskConfig(num_problems=40))[:4]],
                    seq_len=128, pad_id=tokenizer.pad_id, packing=True)
    targets = rows["labels"][rows["labels"] != IGNORE].tolist()
    assert "<think>" in tokenizer.tokenizer.decode(targets) and targets.count(1) == 4


def test_template_that_drops_earlier_reasoning_trains_on_what_it_shows(v3_dir, tmp_path):
    directory = _with_template(v3_dir, tmp_path, DROPS_EARLIER_REASONING)
    eos = "<｜end▁of▁sentence｜>"
    _check_against_transformers(directory, MULTI_TURN[2:], "It is 156." + eos + MULTI_TURN[5]["content"] + eos)


def test_reply_token_straddling_the_generation_prompt_is_trained(v3_dir, tmp_path):
    directory = _with_template(v3_dir, tmp_path, DEEPSEEK_LLM_CHAT)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    _check_against_transformers(directory, conversation, " Hello there.<｜end▁of▁sentence｜>")


def test_a_model_smaller_than_the_tokenizer_fails_naming_both(v3_dir, tmp_path):
    from data_contract.errors import ConfigError
    from dsl_lit.posttrain.run import setup_posttrain

    cfg = compose_config("sft", [f"tokenizer_dir={v3_dir}", "+model.vocab_size=8192", "logger=csv"])
    with pytest.raises(ConfigError, match=r"128815 token ids but model\.vocab_size=8192.*129280|128815.*8192"):
        setup_posttrain(cfg, str(tmp_path / "run"))


@pytest.mark.slow
def test_sft_recipe_with_a_released_tokenizer_and_its_template(v3_dir, tmp_path):
    """recipes/sft.py with tokenizer_dir=<a V3-style release>: rows through V3's chat template, the
    model embedding its 129280 rows; the bundled data is never built for it."""
    run_dir = tmp_path / "sft"
    overrides = [f"hydra.run.dir={run_dir}", f"tokenizer_dir={v3_dir}", "+model.vocab_size=129280", "logger=csv",
                 # one narrow layer: the 129280-row embedding and head are most of the model
                 "model.n_layers=1", "+model.d_model=64", "+model.n_heads=2", "+model.n_kv_heads=1", "+model.ffn_hidden=128",
                 "trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.progress_bar=false",
                 "checkpoint.every_n_steps=0", "checkpoint.every_minutes=0", "task.num_problems=100",
                 "data.seq_len=64", "data.global_batch_size=4", "data.micro_batch_size=2",
                 f"data.cache_dir={tmp_path / 'never_built'}"]
    result = run_python([sys.executable, str(ROOT / "recipes" / "sft.py"), *overrides], cwd=ROOT, timeout=600,
                        env={**os.environ, "WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    with (run_dir / "metrics.csv").open() as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert not (tmp_path / "never_built").exists()


def test_v3_tool_calls_are_the_assistants_and_tool_outputs_are_not(v3_dir):
    """V3's template renders an assistant message without content as its tool calls. (transformers 5
    drops None-valued keys before rendering, which V3's template cannot render, so the text is
    checked against the template's literal output here.)"""
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
             for c in ("Paris", "Rome")]
    conversation = [{"role": "user", "content": "Weather in Paris and Rome?"},
                    {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "content": "18C"}, {"role": "tool", "content": "24C"},
                    {"role": "assistant", "content": "Paris 18C, Rome 24C."}]
    tokenizer = ChatTokenizer.from_dir(v3_dir)
    call = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{{\"city\": \"{}\"}}\n```<｜tool▁call▁end｜>"
    replies = ["<｜tool▁calls▁begin｜>" + call.format("Paris") + "\n" + call.format("Rome")
               + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>", "Paris 18C, Rome 24C.<｜end▁of▁sentence｜>"]
    outputs = "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>24C" \
              "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    text = tokenizer.template.render(conversation)
    assert text == ("<｜begin▁of▁sentence｜><｜User｜>Weather in Paris and Rome?<｜Assistant｜>" + replies[0] + outputs
                    + replies[1])
    encoded = tokenizer.encode_conversation(conversation)
    assert encoded.ids == tokenizer.encode_text(text)
    trained = [i for i, t in zip(encoded.ids, encoded.trained) if t]
    assert tokenizer.tokenizer.decode(trained, skip_special_tokens=False) == "".join(replies)


# -- issue 34: post-training data checked before training, bounded templates -------------------------

USER_TURNS_ONLY = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                   "{{ '<｜User｜>' + message['content'] }}{% endif %}{% endfor %}")


def test_a_template_that_never_shows_the_assistant_trains_on_nothing_and_is_refused(v3_dir, tmp_path, caplog):
    """Before: SFT with this template exited 0 with train/loss 0.0 at every step."""
    tokenizer = ChatTokenizer.from_dir(_with_template(v3_dir, tmp_path, USER_TURNS_ONLY))
    conversations = [tokenizer.encode_conversation(c) for c in task_conversations(TaskConfig(num_problems=40))[:4]]
    with pytest.raises(ConfigError, match="sft train: none of the 4 conversations has a target token"):
        sft_rows(conversations, seq_len=128, pad_id=tokenizer.pad_id, packing=True)
    good = ChatTokenizer.from_dir(v3_dir)
    with caplog.at_level(logging.INFO, logger="dsl_lit.posttrain.chat.rows"):
        sft_rows([good.encode_conversation(c) for c in task_conversations(TaskConfig(num_problems=40))[:4]],
                 seq_len=128, pad_id=good.pad_id, packing=True)
    assert re.search(r"sft train: \d+ target \(assistant\) tokens in 4 conversations", caplog.text)


def test_named_templates_follow_transformers(v3_dir, tmp_path):
    """Before: named templates without a ``default`` silently fell back to the built-in format."""
    named = [{"name": "tool_use", "template": DEEPSEEK_LLM_CHAT}, {"name": "rag", "template": USER_TURNS_ONLY}]
    directory = _with_template(v3_dir, tmp_path, named)
    with pytest.raises(ValueError, match=r"named chat templates \['rag', 'tool_use'\] and none called 'default'"):
        ChatTokenizer.from_dir(directory)
    chosen = ChatTokenizer.from_dir(directory, "tool_use")
    assert chosen.template.source == DEEPSEEK_LLM_CHAT
    with pytest.raises(ValueError, match="none called 'nope'"):
        ChatTokenizer.from_dir(directory, "nope")
    cfg = compose_config("sft", [f"tokenizer_dir={directory}", "+model.vocab_size=129280", "logger=csv"])
    from dsl_lit.posttrain.run import setup_posttrain

    with pytest.raises(ConfigError, match="none called 'default'; pick one with chat_template_name=<name>"):
        setup_posttrain(cfg, str(tmp_path / "run"))


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         r"range\(\) produced more than 1000000 items"),
        ("{{ 'x' * 2000000000 }}", r"str \* int would hold 2000000000 characters"),
        ("{{ (['x' * 3000000] * 1000000)|join }}", r"list \* int would hold 3000008000000 characters"),
        ("{% set s = 'x' * 3000000 %}{{ s + s }}", r"str \+ str would hold 6000000 characters"),
        ("{{ 'x'|center(1000000000) }}", r"the center filter would hold 1000000000 characters"),
        ("{{ '%1000000000d'|format(1) }}", r"the format filter would hold"),
        ("{{ ('x' * 4000000)|replace('x', 'yy') }}", r"the replace filter would hold 8000000 characters"),
        ("{% set x = 2 ** 2000 %}{{ x * x * x }}", r"a product of integers would exceed 4096 bits"),
        ("{{ 10 ** 10000000 }}", r"10 \*\* 10000000 would exceed 4096 bits"),
        ("{% set s = 'y' * 1000000 %}{% for i in range(10) %}{{ s }}{% endfor %}", r"exceeded 4000000 characters"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
        ("{{ ''.__class__.__mro__ }}", "the sandbox blocked the chat template"),
        ("{% for m in messages %}{{ m['content'] ", "does not compile"),
    ],
)
def test_template_bombs_are_refused_naming_the_file(v3_dir, tmp_path, template, message):
    """Before: the nested loops hung SFT, the repetition allocated 2 GB, the power took > 40 s, the
    recursion printed a 1,400-line traceback and the sandbox's block three chained ones."""
    directory = _with_template(v3_dir, tmp_path, template)
    with pytest.raises(ConfigError, match=message) as error:
        ChatTokenizer.from_dir(directory).encode_conversation([{"role": "user", "content": "Hi"},
                                                               {"role": "assistant", "content": "Hello"}])
    assert str(error.value).startswith(str(directory / "tokenizer_config.json"))


def test_render_time_is_bounded(v3_dir, tmp_path, monkeypatch):
    from data_contract import chat_template as module

    monkeypatch.setattr(module, "MAX_RENDER_SECONDS", 0.0)  # any render is over time
    directory = _with_template(v3_dir, tmp_path, "{% for i in range(10) %}{{ i }}{% endfor %}")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: the render ran longer than 0 s"):
        ChatTokenizer.from_dir(directory).template.render([{"role": "user", "content": "Hi"}])


def test_a_huge_template_file_is_refused_before_it_is_read(v3_dir, tmp_path):
    directory = _with_template(v3_dir, tmp_path, "x")
    (directory / "chat_template.jinja").write_text("y" * 1_000_001)
    with pytest.raises(ValueError, match=r"chat_template\.jinja has 1000001 bytes, more than 1000000"):
        ChatTokenizer.from_dir(directory)


def test_common_prefix_is_exact_across_block_boundaries():
    from data_contract.chat_template import _common_prefix

    base = "".join(chr(97 + i % 26) for i in range(20000))
    for cut in (0, 1, 4095, 4096, 4097, 12345, 19999):
        other = base[:cut] + "#" + base[cut + 1:]
        assert _common_prefix(base, other) == cut
    assert _common_prefix(base, base) == 20000 and _common_prefix(base, base[:777]) == 777


def test_dpo_pairs_are_checked_for_targets_too(v3_dir, tmp_path):
    from dsl_lit.posttrain.dpo.data import preference_rows, task_pairs

    tokenizer = ChatTokenizer.from_dir(_with_template(v3_dir, tmp_path, USER_TURNS_ONLY))
    with pytest.raises(ConfigError, match="dpo pairs: none of the 8 conversations has a target token"):
        preference_rows(task_pairs(TaskConfig(num_problems=40), 4), tokenizer, seq_len=128)


def test_a_malformed_sft_dataset_is_counted_and_set_aside(tmp_path, caplog):
    """Bad lines (not JSON, not a conversation) are counted and set aside with one warning; a file
    with none left, or no file, is one line (before: a JSON error's traceback)."""
    import json as _json
    import logging

    from data_contract.errors import ConfigError
    from dsl_lit.posttrain.chat.conversations import read_conversations

    good = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([_json.dumps(good), "{not json", _json.dumps({"messages": "hi"}),
                               _json.dumps({"messages": [{"role": "user", "content": 3}]}), _json.dumps(good)]) + "\n")
    with caplog.at_level(logging.WARNING):
        assert read_conversations(path) == [good["messages"], good["messages"]]
    assert "3 line(s) set aside: 2 (not JSON); 3 (neither a non-empty 'messages' list, 'prompt' and 'completion'" \
        in caplog.text
    # TRL's prompt-completion rows, plain and conversational, are a user turn and the assistant's reply
    trl = tmp_path / "trl.jsonl"
    trl.write_text("\n".join([_json.dumps({"prompt": "2+2?", "completion": "4"}),
                              _json.dumps({"prompt": good["messages"][:1], "completion": good["messages"][1:]}),
                              _json.dumps({"prompt": "2+2?", "completion": ["4"]})]) + "\n")
    with caplog.at_level(logging.WARNING):
        assert read_conversations(trl) == [good["messages"], good["messages"]]
    assert "trl.jsonl: 1 line(s) set aside: 3 (neither" in caplog.text
    (tmp_path / "bad.jsonl").write_text("[1]\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl holds no conversation .*; 1 record\(s\) set aside$"):
        read_conversations(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match=r"^sft\.dataset=.*missing\.jsonl: no such file"):
        read_conversations(tmp_path / "missing.jsonl")


def test_sft_reads_trl_text_rows_and_datasets_directories(tokenizer, tmp_path, caplog):
    """TRL's language-modelling rows (``{"text"}``) are plain documents: ``<bos> text <eos>``, every
    token after the first a target, no chat template; a ``datasets`` save_to_disk directory (a
    Dataset, or a DatasetDict's train split) is read like a JSONL file, bad rows set aside by number."""
    import logging

    import datasets

    from data_contract.errors import ConfigError
    from dsl_lit.posttrain.chat.conversations import Document, encode_example, read_conversations
    from dsl_lit.posttrain.chat.rows import sft_rows

    chat = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    records = [chat, {"text": "The sum of two and two is four."}, {"text": ""}, {"prompt": "2+2?", "completion": "4"}]
    datasets.Dataset.from_list([{"messages": None, "text": None, "prompt": None, "completion": None} | r
                                for r in records]).save_to_disk(str(tmp_path / "rows"))
    with caplog.at_level(logging.WARNING):
        examples = read_conversations(tmp_path / "rows")
    assert "rows: 1 row(s) set aside: 3 (a 'text' that is not a non-empty string)" in caplog.text
    assert examples[1] == Document("The sum of two and two is four.") and examples[0] == examples[2] == chat["messages"]
    document = encode_example(tokenizer, examples[1])
    text_ids = tokenizer.encode_text("The sum of two and two is four.")
    assert document.ids == [tokenizer.bos_id, *text_ids, tokenizer.eos_id]
    assert document.trained == [False] + [True] * (len(text_ids) + 1)
    rows = sft_rows([document], 64, tokenizer.pad_id, packing=False)
    assert (rows["labels"] != -100).sum() == len(text_ids) + 1  # every token but <bos>, the eos included
    # a DatasetDict: its train split; without one, or a directory datasets did not write: one line
    datasets.DatasetDict({"train": datasets.Dataset.from_list([chat])}).save_to_disk(str(tmp_path / "splits"))
    assert read_conversations(tmp_path / "splits") == [chat["messages"]]
    datasets.DatasetDict({"test": datasets.Dataset.from_list([chat])}).save_to_disk(str(tmp_path / "test_only"))
    with pytest.raises(ConfigError, match=r"test_only holds the splits \['test'\] and no 'train' split"):
        read_conversations(tmp_path / "test_only")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match=r"plain is a directory that datasets' save_to_disk did not write"):
        read_conversations(tmp_path / "plain")


def test_sft_epochs_become_the_recorded_max_steps(tmp_path):
    """``sft.epochs`` turns into ``trainer.max_steps`` once the rows are known, validated and written to
    resolved_config.yaml (before: set on the validated config after that file was written, which then
    showed the default max_steps)."""
    import yaml

    from dsl_lit.config import TrainConfig
    from dsl_lit.posttrain.run import PostTrainSetup, train_for_epochs
    from tests.conftest import compose_config

    cfg = TrainConfig.from_hydra(compose_config("sft", ["sft.epochs=2", "data.global_batch_size=8"]),
                                 run_dir=str(tmp_path), post_training=True)
    train_for_epochs(PostTrainSetup(cfg, cfg.post, tokenizer=None, initial_state=None), rows=30)
    assert cfg.trainer.max_steps == 8  # ceil(2 * 30 / 8)
    assert yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())["trainer"]["max_steps"] == 8
