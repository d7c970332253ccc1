"""Pipeline parallelism: how layers are split and placed, layout-independent optimizer state, and
on real gloo process groups, every schedule's gradients, losses and expert loads against one
process running the same micro-batches, routing replay's included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsl_lit.config.optim import OptimConfig
from dsl_lit.memory.recompute import apply_recompute
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.routing_replay import (
    install_routes,
    named_stack_routers,
    recording_routes,
    remove_routes,
)
from dsl_lit.ops import cross_entropy
from dsl_lit.optim import build_optimizer
from dsl_lit.parallel.optimizer_state import (
    load_named_optimizer_state,
    named_optimizer_state,
)
from dsl_lit.parallel.pipeline import (
    PipelineRunner,
    layer_cost,
    prune_to_stages,
    split_layers,
    stages_of_rank,
)
from tests.numerics import assert_close_fp32
from tests.ranks import spawn
from tests.unit.posttrain.test_routing_replay import redraw_biases

V3 = ModelConfig.from_name("deepseek_v3_tiny", n_layers=4, mtp_depth=1, seq_balance_alpha=0.01)
# DeepSeek-V3.2 in sparse training: each query attends to its indexer's top 8 of up to 16 keys, and
# the indexers' KL (inputs detached) is an auxiliary loss made on the stage where each layer is
V32 = ModelConfig.from_name("deepseek_v32_tiny", n_layers=4, mtp_depth=1, seq_balance_alpha=0.01, index_topk=8,
                            index_training="sparse")
# DeepSeek-V4: 4 residual streams between stages, hash-routed first layer (token ids on every stage)
V4 = ModelConfig.from_name("deepseek_v4_tiny", n_layers=4, seq_balance_alpha=0.01)
# ... and with its MTP block (a whole V4 block on the streams) on the last stage, fed the embeddings
# the first stage sends beside the streams
V4_MTP = ModelConfig.from_name("deepseek_v4_tiny", n_layers=4, seq_balance_alpha=0.01, mtp_depth=1)


def test_split_balances_cost_and_gives_the_head_to_the_last_stage():
    cfg = ModelConfig.from_name("deepseek_llm_tiny", n_layers=8)
    split = split_layers(cfg, 4)
    assert [i for stage in split for i in stage] == list(range(8))  # contiguous, all layers, in order
    assert all(stage for stage in split)
    head = cfg.d_model * cfg.vocab_size
    assert head > layer_cost(cfg, 0)  # the tiny model's head outweighs a layer...
    assert len(split[-1]) < len(split[0])  # ...so the last stage gets fewer layers
    costs = [sum(layer_cost(cfg, i) for i in s) + (head if k == 3 else 0) for k, s in enumerate(split)]
    naive = [sum(layer_cost(cfg, i) for i in range(2 * k, 2 * k + 2)) + (head if k == 3 else 0) for k in range(4)]
    assert max(costs) < max(naive)
    assert split_layers(cfg, 8) == [[i] for i in range(8)]
    with pytest.raises(ValueError, match="9 pipeline stages cannot split 8 layers"):
        split_layers(cfg, 9)


def test_stage_placement_per_schedule():
    assert stages_of_rank(1, 4, 1, "1F1B") == [1]
    assert stages_of_rank(1, 4, 2, "Interleaved1F1B") == [1, 5]  # round robin
    assert stages_of_rank(0, 4, 2, "DualPipeV") == [0, 7]  # the V: first and last stage on rank 0
    assert stages_of_rank(3, 4, 2, "DualPipeV") == [3, 4]


def test_optimizer_state_is_keyed_by_name_on_every_stage():
    """Two stages' AdamW states, keyed by parameter name, are the single-process state split in two;
    a stage's optimizer loads the single-process state back (hyperparameters per group, its moments)."""
    model = build_model(V3)
    reference = build_optimizer(model, OptimConfig(lr=1e-3))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    reference.step()
    expected = named_optimizer_state(reference, model)
    assert set(expected["state"]) == {n for n, p in model.named_parameters()}
    split = [[0, 1], [2, 3]]
    seen: dict[str, dict] = {}
    for stage_index in (0, 1):
        stage = build_model(V3)
        stage.load_state_dict(model.state_dict())
        prune_to_stages(stage, split, [stage_index])
        optimizer = build_optimizer(stage, OptimConfig(lr=5e-1))
        load_named_optimizer_state(optimizer, stage, expected)
        assert optimizer.param_groups[0]["lr"] == 1e-3  # the checkpoint's, not the constructor's
        part = named_optimizer_state(optimizer, stage)
        assert set(part["state"]) == {n for n, _ in stage.named_parameters()}
        assert not set(part["state"]) & set(seen)
        seen.update(part["state"])
    assert seen.keys() == expected["state"].keys()
    for name, per_param in expected["state"].items():
        for key, value in per_param.items():
            assert torch.equal(seen[name][key], value), (name, key)


LLM = ModelConfig.from_name("deepseek_llm_tiny", n_layers=4)


def _objective(cfg: ModelConfig, outputs, labels, counts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(objective, detached main loss, detached MTP loss: 0 without MTP); cross_entropy consumes the
    logits, so each once."""
    logits, *mtp = outputs
    loss = cross_entropy(logits, labels) / counts[0]
    mtp_loss = sum((cross_entropy(m, labels[:, 1:]) / counts[1] for m in mtp), torch.zeros(()))
    return loss + 0.3 * mtp_loss, loss.detach(), mtp_loss.detach()


def _reference_step(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, micro: int):
    """One process: the same objective (main + MTP + balance + indexer KL) over the same
    micro-batches, backward into ``model``'s gradients; returns the step's (main loss, MTP loss) and
    the indexers' (KL, recall) over the step, each micro-batch by its share."""
    losses, index = torch.zeros(2), torch.zeros(2)
    counts = ((labels != -100).sum(), (labels[:, 1:] != -100).sum())
    for mb_tokens, mb_labels in zip(tokens.split(micro), labels.split(micro)):
        share = mb_tokens.shape[0] / tokens.shape[0]
        residual = model.residual(mb_tokens)  # what MTP reads (DeepSeek-V4: the streams before their collapse)
        outputs = (model.head(model.collapse(residual)), *(model.mtp_logits(residual, mb_tokens) if len(model.mtp) else []))
        objective, loss, mtp_loss = _objective(model.config, outputs, mb_labels, counts)
        balance = model.balance_loss()
        if balance is not None:
            objective = objective + balance * share
        if model.index_losses() is not None:
            kl, recall = model.index_losses()
            objective = objective + kl * share
            index += torch.stack([kl.detach(), recall]) * share
        objective.backward()
        losses += torch.stack([loss, mtp_loss])
    return losses, index


def _sgd(model: torch.nn.Module, lr: float) -> None:
    """``p -= lr * grad``, then no gradients: an update whose layout differences stay fp32 rounding
    (Adam would divide a near-cancelling gradient entry by itself)."""
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(lr * p.grad)
            p.grad = None


def _worker(rank: int, world: int, init_file: str, schedule: str, family: str, steps: int = 1) -> None:
    torch.set_num_threads(1)  # two processes on two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = {"deepseek_v3": V3, "deepseek_v32": V32, "deepseek_v4": V4, "deepseek_v4_mtp": V4_MTP,
               "deepseek_llm": LLM}[family]
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (8, 16), generator=generator)
        labels = torch.roll(tokens, -1, dims=1)
        labels[:, -1] = -100
        torch.manual_seed(0)
        reference = build_model(cfg)
        torch.manual_seed(0)
        model = build_model(cfg)
        runner = PipelineRunner(model, cfg, dist.group.WORLD, schedule, 2, torch.device("cpu"))
        counts = ((labels != -100).sum(), (labels[:, 1:] != -100).sum())
        seen = []

        def loss_fn(outputs, target, record):
            objective, loss, mtp_loss = _objective(cfg, outputs, target, counts)
            if record:
                seen.append(torch.stack([loss, mtp_loss]))
            return objective

        runner.build_schedule(4, loss_fn)
        history = []
        for step in range(steps):  # SGD steps between: every step's losses and gradients as one process's
            if step:
                _sgd(reference, 0.3)
                _sgd(model, 0.3)
                seen.clear()
            reference_losses, reference_index = _reference_step(reference, tokens, labels, micro=2)
            history.append(reference_losses)
            runner.step(tokens, labels, float(tokens.shape[0]))
            reference_params = dict(reference.named_parameters())
            for name, p in model.named_parameters():
                assert_close_fp32(p.grad, reference_params[name].grad, tokens.numel(), msg=f"step {step}: {name}")
            reference_loads = {n: b for n, b in reference.named_buffers() if n.endswith("load.counts")}
            for name, counts_now in model.named_buffers():
                if name.endswith("load.counts"):  # the schedule's shape-inference pass counted nothing
                    assert torch.equal(counts_now, reference_loads[name]), name
            if runner.has_last:
                assert len(seen) == 4
                # 4 micro-batches' losses, each a sum of 32 tokens' terms, added in the same order
                assert_close_fp32(sum(seen), reference_losses, tokens.numel(), msg=f"step {step}: (loss, mtp loss)")
                assert (reference_losses[1] > 0) == bool(len(reference.mtp))
            assert (runner.balance_total() is not None) == (family != "deepseek_llm")
            # every stage's indexers (a rank may hold none): the KL summed, the recall's mean over all
            # of them, as one process's
            index = runner.index_totals()
            summed = torch.stack([index.get(k, torch.zeros(())) for k in ("index_kl", "index_recall_sum", "index_layers")])
            dist.all_reduce(summed)
            indexers = sum(1 for m in reference.modules() if getattr(m, "index_loss", None) is not None)
            assert summed[2].item() == pytest.approx(indexers)
            assert (indexers > 0) == (family in ("deepseek_v32", "deepseek_v4", "deepseek_v4_mtp"))
            if indexers:
                torch.testing.assert_close(torch.stack([summed[0], summed[1] / summed[2]]), reference_index,
                                           rtol=1e-5, atol=1e-7)
        if steps > 1:  # the steps trained: both losses fell far beyond the tolerance
            assert (history[-1] < history[0] - 1e-3).all(), history
        # validation: the forward-only pass gives the same losses and leaves no gradient behind
        model.eval()
        model.zero_grad(set_to_none=True)
        seen.clear()
        runner.step(tokens, labels, float(tokens.shape[0]), backward=False)
        if runner.has_last:
            assert_close_fp32(sum(seen), reference_losses, tokens.numel(), msg="validation (loss, mtp loss)")
        assert all(p.grad is None for p in model.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "schedule"),
    [("deepseek_v3", "1F1B"), ("deepseek_v3", "DualPipeV"), ("deepseek_v3", "Interleaved1F1B"),
     ("deepseek_v3", "GPipe"), ("deepseek_llm", "DualPipeV"), ("deepseek_v32", "1F1B"), ("deepseek_v4", "DualPipeV")],
)
def test_pipeline_gradients_equal_one_process(tmp_path, family, schedule):
    """Each stage's gradients (MTP, balance loss, DeepSeek-V3.2's indexer KL and the embedding fed to
    MTP included) and the losses (main and MTP) equal the single-process ones for the same 4
    micro-batches, and so does the forward-only validation."""
    spawn(_worker, args=(2, str(tmp_path / "init"), schedule, family), nprocs=2)


@pytest.mark.slow
def test_deepseek_v4_mtp_trains_under_1f1b_as_one_process(tmp_path):
    """DeepSeek-V4 with its MTP block on 2 stages, 1F1B (the last stage on the other rank: the first
    sends the embeddings beside the 4 streams): over 3 steps (SGD between), each step's main and MTP
    losses, every gradient and the forward-only validation equal one process's."""
    spawn(_worker, args=(2, str(tmp_path / "init"), "1F1B", "deepseek_v4_mtp", 3), nprocs=2)


def _routed_model(cfg: ModelConfig, tokens: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor]:
    """V3 with every block recomputed in backward, its routes recorded by a forward (as a sampler
    records them), then its balancing biases redrawn: its own routing now differs from the routes."""
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad(), recording_routes(model, tokens.shape[0]) as recorded:
        model.eval()(tokens)
    model.train()
    redraw_biases(model)
    apply_recompute(model, "full")
    return model, recorded[0]


def _replay_worker(rank: int, world: int, init_file: str, schedule: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tokens = torch.randint(0, V3.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
        labels = torch.roll(tokens, -1, dims=1)
        labels[:, -1] = -100
        counts = ((labels != -100).sum(), (labels[:, 1:] != -100).sum())
        # one process: each micro-batch's routes installed, forward and backward, then the next
        reference, routes = _routed_model(V3, tokens)
        flipped: dict[str, int] = {}
        for mb_tokens, mb_labels, mb_routes in zip(tokens.split(2), labels.split(2), routes.split(2)):
            tapes = install_routes(reference, mb_routes, enforce=True)
            hidden = reference.hidden_states(mb_tokens)
            objective = _objective(V3, (reference.head(hidden), *reference.mtp_logits(hidden, mb_tokens)),
                                   mb_labels, counts)[0]
            (objective + reference.balance_loss() * mb_tokens.shape[0] / tokens.shape[0]).backward()
            for (name, _), tape in zip(named_stack_routers(reference), tapes):
                flipped[name] = flipped.get(name, 0) + int(tape.flipped)
        # the stages: the rows carry this rank's routers' routes; later micro-batches' forwards run
        # before an earlier one's backward recomputes its blocks
        model, _ = _routed_model(V3, tokens)
        names = [name for name, _ in named_stack_routers(model)]
        runner = PipelineRunner(model, V3, dist.group.WORLD, schedule, 2, torch.device("cpu"))
        mine = [names.index(name) for name, _ in named_stack_routers(model)]
        runner.build_schedule(4, lambda outputs, target, record: _objective(V3, outputs, target, counts)[0])
        runner.step(tokens, labels, float(tokens.shape[0]), inputs={"routed_experts": routes[:, :, mine]},
                    replay_routes=True)
        reference_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert_close_fp32(p.grad, reference_params[name].grad, tokens.numel(), msg=name)
        got = {name: int(count) for name, count in runner.route_flips().items()}
        assert got == {name: flipped[name] for name, _ in named_stack_routers(model)}, (got, flipped)
        assert all(count > 0 for count in got.values())  # the redrawn biases flip tokens in every router
        remove_routes(model)  # as GRPO does after its step
        # the next step's rows are shorter (an RL step's rows are as long as its longest rollout): the
        # stages learn the new activation shapes (before, the receiving stage kept the first step's)
        seen: list[torch.Tensor] = []

        def shorter_loss(outputs, target, record):
            objective, loss, _ = _objective(V3, outputs, target, counts)
            if record:  # not the shape-inference pass (on uninitialised buffers)
                seen.append(loss)
            return objective

        runner.build_schedule(4, shorter_loss, (8, 12))
        runner.step(tokens[:, :12], labels[:, :12], 8.0)
        assert not runner.has_last or (len(seen) == 4 and all(torch.isfinite(x) for x in seen)), seen
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "DualPipeV"])
def test_routing_replay_through_the_schedule_equals_one_process(tmp_path, schedule):
    """RL's routing replay under pipeline parallelism: each stage replays the sampler's routes of its
    routers, micro-batch by micro-batch, and activation recompute replays the routes of the
    micro-batch it recomputes (not the last one installed): gradients equal one process replaying
    the same routes, and each router's flips are counted once."""
    spawn(_replay_worker, args=(2, str(tmp_path / "init"), schedule), nprocs=2)
