"""Pipeline parallelism: split a ``Transformer`` into stages and run a step with a schedule from
``torch.distributed.pipelining`` (GPipe, 1F1B, Interleaved1F1B, DualPipeV).

How a model becomes stages (the model code knows nothing of it):

- :func:`split_layers` cuts the layers into contiguous stages of balanced *cost*: a layer costs
  its activated matmul weights as the family's FLOPs count them (``FamilySpec.flops``), and the
  last stage also pays for the output head and the MTP modules (multi-token prediction lives on
  the last stage, where the head is); the embedding lookup costs no matmul. Every stage keeps at
  least one layer.
- :func:`stages_of_rank` places stages on pp ranks: one per rank (GPipe, 1F1B), round-robin
  (Interleaved1F1B), or the V of DualPipeV (rank r holds stages r and 2*pp-1-r, so the first
  and the last stage share rank 0).
- :func:`prune_to_stages` deletes from this rank's model what its stages do not own. Module
  names stay the single-device ones (``layers.7...``), so checkpoints reshard by name.
- :class:`PipelineStageModule` is one stage's forward over the shared (pruned) model. The MTP
  modules need the token embeddings, which live on the first stage: the first stage sends them
  down the pipeline beside the hidden states, so their gradient flows back to the one embedding
  (no duplicated, tied embedding to keep in sync as Megatron does).
- Per-row inputs other than the tokens (per-document ``positions`` of packed rows, the attention
  mask ``key_valid`` of padded or packed rows) are not activations: every stage gets its
  micro-batch's slice as keyword arguments of the schedule's ``step``. RL's ``routed_experts``
  (the experts the sampler sent each token to, :mod:`dsl_lit.models.common.routing_replay`) travel
  so too: each stage installs its routers' share per micro-batch, to replay or to count flips.
- Under context parallelism (``cp_group``) every stage holds its cp rank's positions: the first
  stage embeds them, each stage's attention gathers keys over the cp ranks of its pp rank, and the
  hidden states (and embeddings) sent down the pipeline are [rows, seq / cp, d_model]; the last
  stage's MTP gathers the embeddings to shift them along whole rows.
- The sequence-wise balance loss of MoE layers is made where the layer is, not on the last stage:
  :class:`_AttachAuxLoss` hooks its gradient onto the stage's output (as DeepSeek-V2's reference
  code does), scaled by the micro-batch's share of the step's sequences; DeepSeek-V3.2's indexer
  KL (its inputs detached: it trains the indexers only) rides the same way.

The loss function the schedule calls on the last stage is the LightningModule's own
``loss_from_outputs``, divided by step-wide counts, so the schedule runs with
``scale_grads=False`` and accumulated gradients equal the single-device ones. Its ``target`` is
any tensor split along rows like the inputs: the strategy passes row indices, so an objective can
read every field of its micro-batch (labels, advantages, reference log-probs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.pipelining import PipelineStage

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.pipeline_schedules import schedule as schedule_row
from dsl_lit.config.pipeline_schedules import stages_of_rank
from dsl_lit.models import spec_of
from dsl_lit.models.common.compute_copies import refresh_compute_copies
from dsl_lit.models.common.moe import MoE
from dsl_lit.models.common.routing_replay import RouteTape, install_routes, layer_of, named_stack_routers
from dsl_lit.parallel.context_parallel import ContextParallelKeys


def layer_cost(cfg: ModelConfig, layer_id: int) -> float:
    """Activated matmul weights of one block, as the family's FLOPs count them (attention + dense
    FFN, or router + shared + top-k experts)."""
    return float(spec_of(cfg).flops.block_params_per_token(cfg, layer_id))


def split_layers(cfg: ModelConfig, n_stages: int) -> list[list[int]]:
    """Contiguous layer ranges, one per stage, minimising the most expensive stage's cost.

    The last stage also carries the head (d x vocab) and each MTP module (its block, its
    projection and the head again)."""
    costs = [layer_cost(cfg, i) for i in range(cfg.n_layers)]
    tail = float(spec_of(cfg).flops.last_stage_params_per_token(cfg))
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} pipeline stages cannot split {n} layers (each stage needs one)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, start: int, end: int) -> float:
        return prefix[end] - prefix[start] + (tail if stage == n_stages - 1 else 0.0)

    # best[s][i]: least max-cost of splitting layers [0, i) into stages 0..s-1 (exact DP; n is small)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(n_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [list(range(a, b)) for a, b in reversed(bounds)]


def prune_to_stages(model: nn.Module, stage_layers: list[list[int]], owned: list[int]) -> None:
    """Delete the layers, embedding, head and MTP modules that none of ``owned`` stages use."""
    keep = {layer for s in owned for layer in stage_layers[s]}
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    last = len(stage_layers) - 1
    if 0 not in owned:
        model.tok_embeddings = None
    if last not in owned:  # the final norm, head, MTP (and what else the family runs after its last layer)
        for name in model.last_stage_modules:
            setattr(model, name, nn.ModuleDict() if isinstance(getattr(model, name), nn.ModuleDict) else None)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``hidden``; in backward, gives ``aux`` the gradient 1, so an auxiliary loss
    computed inside a stage is optimised without travelling to the last stage."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return hidden.clone()  # not a view: pipelining schedules detach_() stage outputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


class PipelineStageModule(nn.Module):
    """One pipeline stage over the rank's shared, pruned ``Transformer``.

    ``forward(x, embeddings=None)``: the first stage takes token ids, later stages the previous
    stage's hidden states (and, with MTP, the token embeddings). The last stage returns the
    logits, then one logits tensor per MTP depth; the others return what the next stage takes.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], is_first: bool, is_last: bool,
                 with_mtp: bool = True, cp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.model = model  # shared by the rank's stages; parameters() below lists only ours
        self.cp_group = cp_group
        """Context parallelism: the stage runs its cp rank's positions (None: whole rows)."""
        self.layer_ids = layer_ids
        self.is_first, self.is_last = is_first, is_last
        # from the config: stages other than the last have no MTP modules after pruning
        self.carries_embeddings = model.config.mtp_modules > 0
        self.with_mtp = with_mtp
        """Whether the last stage also returns the MTP logits (post-training trains the main head only)."""
        self.balance_scale = 0.0
        """1 / (sequences in the step on this rank), set per step: the micro-batch's share of the
        balance loss is its rows times this."""
        self.balance_total: torch.Tensor | None = None
        """Detached sum of this stage's balance losses over the step (for the metric)."""
        self.index_totals: dict[str, torch.Tensor] = {}
        """DeepSeek-V3.2's indexers on this stage, over the step: ``index_kl`` (their KL, each micro-
        batch's times its share of the step's sequences), ``index_recall_sum`` (their top-k recalls,
        weighted alike) and ``index_layers`` (how many indexers: the recall's mean needs every stage's)."""
        self.in_metadata_pass = False
        self._indexers: list[nn.Module] | None = None
        self.loss_scale = 1.0
        """fp16 loss scaling: the attached balance loss's gradient is scaled like the main loss's."""
        self.replay_routes = False
        """RL on an MoE: send tokens to the sampler's recorded experts (``routed_experts``), not only
        count where the routers differ from them."""
        self.route_tapes: list[tuple[str, RouteTape]] = []
        """This step's tapes of this stage's routers, one per micro-batch forward (their flip counts)."""

    def owned_modules(self) -> list[nn.Module]:
        m = self.model
        owned: list[nn.Module] = [m.layers[str(i)] for i in self.layer_ids]
        if self.is_first:
            owned.append(m.tok_embeddings)
        if self.is_last:
            owned += [getattr(m, name) for name in m.last_stage_modules]
        return owned

    def parameters(self, recurse: bool = True):  # noqa: D102 - only this stage's weights
        seen: set[int] = set()
        for module in self.owned_modules():
            for p in module.parameters(recurse):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p in self.parameters(recurse):
            yield prefix + names[id(p)], p

    def moe_layers(self) -> list[MoE]:
        """This stage's MoE layers (the MTP blocks' too, on the last stage)."""
        return [m for module in self.owned_modules() for m in module.modules() if isinstance(m, MoE)]

    def indexers(self) -> list[nn.Module]:
        """This stage's sparse-attention modules (DeepSeek-V3.2, V4's CSA): they leave an indexer KL.
        Found once: the stage's modules are fixed once the model is pruned."""
        if self._indexers is None:
            self._indexers = [m for module in self.owned_modules() for m in module.modules() if hasattr(m, "index_loss")]
        return self._indexers

    @contextlib.contextmanager
    def metadata_pass(self) -> Iterator[None]:
        """``torch.distributed.pipelining`` runs each stage once on the first micro-batch (or on
        uninitialised buffers) to learn shapes; that pass must not count expert loads or losses."""
        loads = [(m.gate.load.counts, m.gate.load.counts.clone()) for m in self.moe_layers()]
        self.in_metadata_pass = True
        try:
            yield
        finally:
            self.in_metadata_pass = False
            for counts, saved in loads:
                counts.copy_(saved)

    def forward(
        self,
        x: torch.Tensor,
        embeddings: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> Any:
        m = self.model
        refresh_compute_copies(m)
        if routed_experts is not None:  # the sampler's routes of the rank's routers: this stage's share
            names = [name for name, _ in named_stack_routers(m) if layer_of(name) in self.layer_ids]
            tapes = install_routes(m, routed_experts, self.replay_routes, layers=self.layer_ids)
            if not self.in_metadata_pass:
                self.route_tapes += list(zip(names, tapes))
        shard = None
        if self.cp_group is not None:  # whole rows' length: the first stage's ids, or the shards' x cp
            seq = x.shape[1] if self.is_first else x.shape[1] * dist.get_world_size(self.cp_group)
            shard = ContextParallelKeys(seq, self.cp_group, x.device)
            positions = shard.query_positions.expand(x.shape[0], -1)
            x = shard.shard(x) if self.is_first else x
            token_ids = shard.shard(token_ids) if token_ids is not None else None  # V4's hash routing: whole rows
        if self.is_first:
            ids, x = x, m.embed(x)
            embeddings = m.mtp_embeddings(ids, x) if self.carries_embeddings else None
        x = m.run_layers(x, self.layer_ids, positions, key_valid, token_ids, shard)
        if not self.is_last:
            x = self._attach_aux_losses(x)
            if not self.carries_embeddings:
                return x
            # a stage's outputs must be its own tensors (the zero-bubble schedules detach_ them)
            return x, embeddings if self.is_first else embeddings.clone()
        logits = m.head(m.collapse(x))
        mtp_logits = m.mtp_logits(x, embeddings, shard) if len(m.mtp) and self.with_mtp else []  # from the residual
        logits = self._attach_aux_losses(logits)  # after the MTP blocks ran: theirs count too
        return (logits, *mtp_logits) if mtp_logits else logits

    def _attach_aux_losses(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's auxiliary losses (MoE balance, DeepSeek-V3.2's indexer KL), this micro-batch's
        share of the step's, hooked onto its output so the schedule's backward reaches them."""
        if not torch.is_grad_enabled():
            return x
        share = x.shape[0] * self.balance_scale
        losses = [m.balance_loss for m in self.moe_layers() if m.balance_loss is not None]
        aux = torch.stack(losses).sum() * share if losses else None
        if aux is not None and not self.in_metadata_pass:
            self.balance_total = aux.detach() if self.balance_total is None else self.balance_total + aux.detach()
        indexers = [m for m in self.indexers() if m.index_loss is not None]
        if indexers:
            kl = torch.stack([m.index_loss for m in indexers]).sum() * share
            aux = kl if aux is None else aux + kl
            if not self.in_metadata_pass:
                add = {"index_kl": kl.detach(),
                       "index_recall_sum": torch.stack([m.index_recall for m in indexers]).sum() * share,
                       "index_layers": torch.tensor(float(len(indexers)), device=x.device) * share}
                for name, value in add.items():
                    self.index_totals[name] = self.index_totals[name] + value if name in self.index_totals else value
        return x if aux is None else _AttachAuxLoss.apply(x, aux * self.loss_scale)


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose shape-inference passes leave no trace in our counters."""

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self.submod.metadata_pass():
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self.submod.metadata_pass():
            return super()._prepare_backward_infra(*args, **kwargs)


class PipelineRunner:
    """This rank's stages: prunes the model at construction (before the optimizer and tensor
    parallelism see it), builds the schedule at the first step (when the number of micro-batches
    is known), then runs each optimizer step's forwards and backwards with :meth:`step`."""

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        pp_group: dist.ProcessGroup,
        schedule: str,
        virtual_stages: int,
        device: torch.device,
        with_mtp: bool = True,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.pp_group, self.schedule_name, self.device = pp_group, schedule, device
        self.row = schedule_row(schedule)
        if self.row.splits_backward:  # before any block compiles (compile is the last transform)
            # each backward runs as input then weight gradients, the first keeping the graph for the
            # second (retain_graph): compiled blocks must not donate the buffers they saved for backward
            # (AOTAutograd's donated_buffer), or their backward refuses to run (found by the compiled
            # DualPipeV layout of tests/e2e/recipes/test_compile.py)
            import torch._functorch.config

            torch._functorch.config.donated_buffer = False
        self.cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        pp = dist.get_world_size(pp_group)
        virtual = self.row.chunks_per_rank(virtual_stages)
        self.n_stages = pp * virtual
        self.stage_layers = split_layers(cfg, self.n_stages)
        self.owned = stages_of_rank(dist.get_rank(pp_group), pp, virtual, schedule)
        self.owner = {s: r for r in range(pp) for s in stages_of_rank(r, pp, virtual, schedule)}
        """The pp rank holding each stage."""
        self.prune(model)
        self.modules = [
            PipelineStageModule(model, self.stage_layers[s], s == 0, s == self.n_stages - 1, with_mtp, cp_group)
            for s in self.owned
        ]
        self.has_first = any(m.is_first for m in self.modules)
        self.has_last = any(m.is_last for m in self.modules)
        self.schedule: Any = None
        self._n_microbatches = 0
        self._rows_shape: tuple[int, ...] | None = None

    def prune(self, model: nn.Module) -> None:
        """Cut ``model`` (the policy, or a frozen copy of it such as a KL reference) to this rank's stages."""
        prune_to_stages(model, self.stage_layers, self.owned)

    def holds_stages_only(self, model: nn.Module) -> bool:
        """Whether ``model`` was cut to this rank's stages (not a whole copy)."""
        return set(model.layers.keys()) == {str(i) for s in self.owned for i in self.stage_layers[s]}

    def build_schedule(self, n_microbatches: int, loss_fn: Callable[..., torch.Tensor],
                       rows_shape: tuple[int, ...] | None = None) -> None:
        """Create the stages and the schedule, again when the number of micro-batches or the step's
        ``rows_shape`` changes (the stages learn their activations' shapes once, in their first
        step: an RL step's rows are as long as its longest rollout)."""
        if self.schedule is not None and (n_microbatches, rows_shape) == (self._n_microbatches, self._rows_shape):
            return
        self._rows_shape = rows_shape
        stages = [
            _Stage(module, s, self.n_stages, self.device, group=self.pp_group)
            for module, s in zip(self.modules, self.owned)
        ]
        schedule_cls = getattr(pipelining, self.row.torch_class)
        arg: Any = stages if self.row.stages_per_rank != 1 else stages[0]  # multi-stage schedules take a list
        last = next((m for m in self.modules if m.is_last), None)

        def stage_loss(outputs: Any, target: torch.Tensor) -> torch.Tensor:
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            return loss_fn(outputs, target, record=last is not None and not last.in_metadata_pass)

        self.schedule = schedule_cls(arg, n_microbatches=n_microbatches, loss_fn=stage_loss, scale_grads=False)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn

    def step(
        self,
        input_ids: torch.Tensor,
        target: torch.Tensor,
        step_sequences: float,
        backward: bool = True,
        loss_scale: float = 1.0,
        inputs: dict[str, torch.Tensor] | None = None,
        replay_routes: bool = False,
    ) -> None:
        """Forward and backward of every micro-batch (gradients accumulate in the parameters), or
        with ``backward=False`` the forwards and losses only (validation). ``target`` reaches the
        loss function split into micro-batches; ``inputs`` (``positions``, ``key_valid``: rows
        first) reach every stage split the same way (``routed_experts`` among them: the sampler's
        routes, replayed with ``replay_routes`` and compared either way, :meth:`route_flips`)."""
        for module in self.modules:
            module.balance_scale = 1.0 / step_sequences
            module.balance_total = None
            module.index_totals = {}
            module.loss_scale = loss_scale
            module.replay_routes, module.route_tapes = replay_routes, []
        args = (input_ids,) if self.has_first else ()
        inputs = inputs or {}
        if self.modules[0].model.needs_token_ids:  # every stage's layers read them (V4's hash routing)
            inputs = {**inputs, "token_ids": input_ids}
        if backward:
            self.schedule.step(*args, target=target if self.has_last else None, return_outputs=False, **inputs)
        else:
            self._forward_only(input_ids, target, inputs)

    @torch.no_grad()
    def _forward_only(self, input_ids: torch.Tensor, target: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
        """Validation: micro-batch by micro-batch through the stages in order, with blocking
        point-to-point sends (torch's zero-bubble schedules have no forward-only mode). Stage
        outputs travel in fp32 (the residual stream's dtype under autocast)."""
        pp_rank = dist.get_rank(self.pp_group)
        owner = self.owner
        mine = dict(zip(self.owned, self.modules))
        n, (rows, seq) = self._n_microbatches, input_ids.shape
        model = self.modules[0].model
        carried = 2 if self.modules[0].carries_embeddings else 1
        size = rows // n
        for k, (mb_tokens, mb_target) in enumerate(zip(input_ids.split(size), target.split(size))):
            mb_inputs = {name: value[k * size : (k + 1) * size] for name, value in inputs.items()}
            held: Any = mb_tokens
            for s in range(self.n_stages):
                if owner[s] != pp_rank:
                    continue
                if s > 0 and owner[s - 1] != pp_rank:  # receive the previous stage's outputs
                    residual = model.residual_shape(mb_tokens.shape[0], seq // self.cp)
                    shapes = [residual, (mb_tokens.shape[0], seq // self.cp, model.config.d_model)][:carried]
                    held = tuple(torch.empty(shape, device=self.device) for shape in shapes)
                    for t in held:
                        dist.recv(t, group=self.pp_group, group_src=owner[s - 1])
                stage_args = held if isinstance(held, tuple) else (held,)
                out = mine[s](*stage_args, **mb_inputs)
                if s == self.n_stages - 1:
                    outputs = out if isinstance(out, tuple) else (out,)
                    self._loss_fn(outputs, mb_target, record=True)
                    continue
                held = out if isinstance(out, tuple) else (out,)
                if owner[s + 1] != pp_rank:
                    for t in held:
                        dist.send(t.float().contiguous(), group=self.pp_group, group_dst=owner[s + 1])

    def route_flips(self) -> dict[str, torch.Tensor]:
        """Tokens whose router's own choice differed from the sampler's in this step, by router name
        (this rank's stages' routers; empty when the rows carried no routes)."""
        flipped: dict[str, torch.Tensor] = {}
        for module in self.modules:
            for name, tape in module.route_tapes:
                flipped[name] = flipped[name] + tape.flipped if name in flipped else tape.flipped
        return flipped

    def index_totals(self) -> dict[str, torch.Tensor]:
        """This rank's stages' :attr:`PipelineStageModule.index_totals`, summed."""
        totals: dict[str, torch.Tensor] = {}
        for module in self.modules:
            for name, value in module.index_totals.items():
                totals[name] = totals[name] + value if name in totals else value
        return totals

    def balance_total(self) -> torch.Tensor | None:
        totals = [m.balance_total for m in self.modules if m.balance_total is not None]
        return torch.stack(totals).sum() if totals else None
