"""Rollout routing replay (R3) and the router-flip rate: the training forward of GRPO's rows sends
each token to the experts the sampler chose, and says how often its own router would have chosen
otherwise.

The mismatch is made on purpose: after sampling, every router's balancing bias is redrawn (it
changes which experts are picked, never the gate values), as a bias update, another precision or
a sharded sampler would. Without replay the training forward then flips tokens and its log-probs
leave the sampler's; with replay it computes the sampler's network again (log-probs equal to fp32
rounding) while still counting the flips its own router would have made, and the router keeps its
gradient."""

from __future__ import annotations

import pytest
import torch

from dsl_lit.inference.generation import generate, positions_from_mask
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.routing_replay import (
    install_routes,
    layer_of,
    named_stack_routers,
    recording_routes,
    remove_routes,
    stack_routers,
)
from dsl_lit.posttrain.grpo.rollout import Rollouts, training_rows
from dsl_lit.posttrain.logps import token_logps
from tests.numerics import assert_close_fp32

PROMPTS = [[5, 9, 14], [5, 9, 14], [7, 3, 3, 8, 21, 4], [7, 3, 3, 8, 21, 4]]  # left padding in the call


def sampled_rows(model: torch.nn.Module, prompts: list[list[int]] = PROMPTS, new_tokens: int = 10) -> dict:
    """GRPO's rows of one sampled batch, with the sampler's log-probs and routes (groups reordered:
    each row must keep its own)."""
    with recording_routes(model, len(prompts)) as recorded:
        out = generate(model, prompts, new_tokens, temperature=1.0, eos_token_id=2, pad_token_id=0,
                       generator=torch.Generator().manual_seed(3))
    width = out.prompt_length
    routes = [r[width - len(p): width + len(c) - 1].to(torch.int16)
              for r, p, c in zip(recorded[0], prompts, out.completions)]
    logprobs = [row[: len(c)].tolist() for row, c in zip(out.logprobs, out.completions)]
    rollouts = Rollouts(prompts, out.completions, torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4), {}, 2,
                        logprobs, routes)
    return training_rows(Rollouts.cat([rollouts.select([1]), rollouts.select([0])]), pad_id=0, eos_id=2)[0]


def train_logps(model: torch.nn.Module, rows: dict) -> torch.Tensor:
    valid = rows["attention_mask"].bool()
    logits = model.head(model.hidden_states(rows["input_ids"], positions_from_mask(valid), valid))
    return token_logps(logits, rows["labels"])


def redraw_biases(model: torch.nn.Module, seed: int = 7) -> None:
    """Each router's bias from its layer's own seed: a pipeline rank holding some layers redraws
    them as one process redraws all."""
    for name, router in named_stack_routers(model):
        generator = torch.Generator().manual_seed(seed + 1000 * layer_of(name))
        router.expert_bias.copy_(torch.randn(router.expert_bias.shape, generator=generator) * 0.003)


def tiny_moe(backend: str = "grouped_mm") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("deepseek_v3_tiny", n_layers=3, expert_backend=backend)).eval()


def test_the_sampler_records_every_forwarded_position_of_every_router():
    model = tiny_moe()
    rows = sampled_rows(model)
    routed, valid = rows["routed_experts"], rows["attention_mask"].bool()
    cfg = model.config
    assert routed.shape == (*rows["input_ids"].shape, len(stack_routers(model)), cfg.n_activated_experts)
    assert len(stack_routers(model)) == cfg.n_layers - cfg.n_dense_layers
    # recorded exactly where the training forward sees a real token, -1 at padding
    assert torch.equal((routed >= 0).all(dim=(2, 3)), valid) and torch.equal((routed < 0).all(dim=(2, 3)), ~valid)
    assert int(routed.max()) < cfg.n_routed_experts
    # the sampler's own routing: in fp32 the training forward's routers choose the same experts (0
    # measured; at most one token per router where a near-tie meets another CPU's rounding, while a
    # route off by one position flips most tokens)
    tapes = install_routes(model, routed, enforce=False)
    with torch.no_grad():
        train_logps(model, rows)
    remove_routes(model)
    assert all(int(t.flipped) <= 1 for t in tapes), [int(t.flipped) for t in tapes]


@pytest.mark.parametrize("backend", ["grouped_mm", "split", "loop"])
def test_replay_trains_the_samplers_network_when_the_router_would_flip(backend):
    model = tiny_moe(backend)
    rows = sampled_rows(model)
    mask = rows["labels"] != -100
    rollout = rows["rollout_logps"][mask]
    n = model.config.d_model * model.config.n_layers * rows["input_ids"].shape[1]
    redraw_biases(model)  # the training forward's routers now pick other experts for many tokens
    with torch.no_grad():
        tapes = install_routes(model, rows["routed_experts"], enforce=False)
        free = train_logps(model, rows)[mask]
        flipped_free = [int(t.flipped) for t in tapes]
        tapes = install_routes(model, rows["routed_experts"], enforce=True)
        replayed = train_logps(model, rows)[mask]
        flipped_replayed = [int(t.flipped) for t in tapes]
    remove_routes(model)
    tokens = int(rows["attention_mask"].sum())
    # measured: 13 and 15 of 54 tokens flip (a bias of std 0.003 against the tiny model's scores)
    assert all(0.05 * tokens < f < tokens for f in flipped_free)
    assert flipped_replayed == flipped_free  # the flips are measured whether or not they are replayed
    assert (free - rollout).abs().max() > 1e-3  # another network: the ratio is not 1
    assert_close_fp32(replayed, rollout, n)  # the sampler's network again


def test_the_router_keeps_its_gradient_under_replay():
    """Replay swaps which experts a token goes to; the gate values are still the router's sigmoid
    scores of those experts, so the router learns (Megatron's router replay). Replaying the
    router's own choices is the plain forward, gradient for gradient."""
    model = tiny_moe().train()
    rows = sampled_rows(model)
    for router in stack_routers(model):
        router.load.counts.zero_()

    def grads(routes: torch.Tensor | None) -> dict[str, torch.Tensor]:
        model.zero_grad()
        if routes is not None:
            install_routes(model, routes, enforce=True)
        loss = -train_logps(model, rows).sum()
        loss.backward()
        remove_routes(model)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(None)
    own = grads(rows["routed_experts"])
    assert plain.keys() == own.keys()
    for name in plain:
        torch.testing.assert_close(own[name], plain[name], rtol=0, atol=0, msg=name)
    redraw_biases(model)
    replayed = grads(rows["routed_experts"])
    routers = [n for n in replayed if n.endswith("gate.weight")]
    assert len(routers) == len(stack_routers(model))
    assert all(replayed[n].abs().sum() > 0 and replayed[n].isfinite().all() for n in routers)


def test_rows_from_another_shape_are_refused():
    model = tiny_moe()
    rows = sampled_rows(model)
    install_routes(model, rows["routed_experts"][:, 1:], enforce=True)
    with pytest.raises(RuntimeError, match="routing replay: this forward routes"):
        with torch.no_grad():
            train_logps(model, rows)
    remove_routes(model)
    with pytest.raises(RuntimeError, match="carry 1 routers' choices, the model has 2"):
        install_routes(model, rows["routed_experts"][:, :, :1], enforce=True)


def test_a_dense_model_records_nothing():
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny", n_layers=2)).eval()
    with recording_routes(model, 2) as recorded:
        generate(model, [[5, 9], [7]], 4, pad_token_id=0)
    assert recorded == []


def test_deepseek_v4_replays_its_top_k_layers_and_its_hash_layers_need_nothing():
    """DeepSeek-V4: the sampler (KV cache, left-padded prompts) and the training forward over GRPO's
    padded rows compute the same log-probs; routes are recorded for the top-k layers only (a hash
    layer's experts follow from the token), and replaying them undoes a redrawn bias."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("deepseek_v4_tiny", index_training="off")).eval()
    rows = sampled_rows(model)
    cfg = model.config
    assert rows["routed_experts"].shape[2] == len(stack_routers(model)) == cfg.n_layers - cfg.n_hash_layers
    mask = rows["labels"] != -100
    rollout = rows["rollout_logps"][mask]
    n = cfg.d_model * cfg.n_layers * rows["input_ids"].shape[1]
    with torch.no_grad():
        assert_close_fp32(train_logps(model, rows)[mask], rollout, n)
        redraw_biases(model)
        free = train_logps(model, rows)[mask]
        install_routes(model, rows["routed_experts"], enforce=True)
        replayed = train_logps(model, rows)[mask]
    remove_routes(model)
    assert (free - rollout).abs().max() > 1e-3  # the redrawn bias moved the routers: another network
    assert_close_fp32(replayed, rollout, n)
