"""SFT data and objective: the chat template and prompt masking, packing isolation (a packed row
computes what its conversations compute alone), and the real recipe end to end (its checkpoint then
starts DPO in tests/test_dpo.py's style)."""

from __future__ import annotations

import pytest
import torch

from dsl_lit.config import TrainConfig
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.posttrain import TaskConfig
from dsl_lit.data.arithmetic import problems
from dsl_lit.data.chat import ChatTokenizer
from dsl_lit.data.conversations import task_conversations
from dsl_lit.data.datamodule import PretrainDataModule
from dsl_lit.data.sft import IGNORE, document, packed_rows, padded_rows, sft_rows
from dsl_lit.models import ModelConfig
from dsl_lit.modules import SFTModule
from dsl_lit.ops import cross_entropy
from tests.conftest import compose_config
from tests.numerics import assert_close_fp32


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    """The bundled corpus's tokenizer (the recipes' default), built into .cache/ on first use."""
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
    encoded = tokenizer.encode_conversation(CONVERSATION)
    ids, trained = encoded.ids, encoded.trained
    assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.user_id) == 2 and ids.count(tokenizer.assistant_id) == 2
    assert ids.count(tokenizer.eos_id) == 2 and ids[-1] == tokenizer.eos_id
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
    assert labels[ids.index(tokenizer.assistant_id) - 1] == IGNORE  # the user's turn is masked
    prompt = tokenizer.encode_prompt(CONVERSATION[:2])
    assert prompt[-1] == tokenizer.assistant_id and ids[: len(prompt)] == prompt
    with pytest.raises(ValueError, match="role"):
        tokenizer.encode_conversation([{"role": "robot", "content": "hi"}])


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
    name = "deepseek_llm_tiny" if family == "deepseek_llm" else "deepseek_v3_tiny"
    cfg = ModelConfig.from_name(name, n_layers=2, mtp_depth=0) if family == "deepseek_v3" else \
        ModelConfig.from_name(name, n_layers=2)
    module = SFTModule(cfg, OptimConfig(), ScheduleConfig(name="constant", warmup_steps=0), micro_batch_size=4,
                       total_steps=1)
    module.configure_model()
    return module.eval()


@pytest.mark.parametrize("family", ["deepseek_llm", "deepseek_v3"])
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
