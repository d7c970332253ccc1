"""Our Transformer as an ``lm_eval`` language model: what lm-evaluation-harness calls to score
and generate text.

The three request types follow lm-eval's ``hf`` backend (``HFLM``) step for step, so that a
checkpoint scores the same here and through ``AutoModelForCausalLM`` on its export (tested):
the same tokenization of context and continuation (``TemplateLM._encode_pair``), the same left
truncation to ``max_length`` (the model's ``max_seq_len``), the same rolling windows, stop
sequences and post-processing, and lm-eval's own ``Collator`` for the batching order and the
reuse of one forward for continuations that share everything but their last token.

What differs is how the model runs: loglikelihood batches are right-padded and the output head
runs only on the continuation positions (a [batch, seq, vocab] tensor of log-probs is never
built), rolling windows of all documents are batched together, and generation uses the batched
KV-cache generator, stopping each sequence as soon as its text holds a stop sequence.

Several processes (the training loop's ranks) split the requests, as lm-eval's data-parallel
backends do: each holds a whole model, and ``all_gather``/``gather_object``/``barrier`` go
through ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from dsl_lit.evaluation.tokenizer import EvalTokenizer
from dsl_lit.inference.generation import generate

Request = tuple[tuple[str, str] | None, list[int], list[int]]
"""(the strings it came from, context token ids, continuation token ids)."""


def has_prefix(text: str, prefix: str | None) -> bool:
    return bool(prefix) and text.startswith(prefix)


class DslLitLM(TemplateLM):
    """``model``: a whole single-device Transformer (a training run's sharded model is gathered
    first). ``autocast_dtype``: run under ``torch.autocast`` (bf16 training), else the weights'
    dtype. ``max_length`` defaults to the model's ``max_seq_len``, as the ``hf`` backend reads
    ``max_position_embeddings`` from an export."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: EvalTokenizer,
        batch_size: int = 16,
        max_gen_toks: int = 256,
        max_length: int | None = None,
        autocast_dtype: torch.dtype | None = None,
        model_info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.eval_tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.max_length = max_length or model.config.max_seq_len
        self.autocast_dtype = autocast_dtype
        self.model_info = dict(model_info or {})
        self._device = next(model.parameters()).device
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    # -- what lm-eval asks of a model ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.eval_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.eval_tokenizer.bos_id
        return bos if bos is not None else self.eval_tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return self.eval_tokenizer.name.replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """Goes into results.json's ``config`` (lm-eval calls it on rank 0)."""
        return self.model_info

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """As ``HFLM.tok_encode``: the tokenizer's special tokens unless asked otherwise or the
        string already starts with the begin-of-sequence text."""
        if add_special_tokens is None:
            add_special_tokens = not has_prefix(string, self.eval_tokenizer.token_text(self.prefix_token_id))
        return self.eval_tokenizer.encode(string, add_special_tokens)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.eval_tokenizer.decode(tokens, skip_special_tokens)

    # -- distributed primitives lm-eval's evaluator uses with several ranks ----------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # -- running the model ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        """Eval mode (MoE routers count no load, no balance loss), no autograd, autocast if asked."""
        was_training = self.model.training
        self.model.eval()
        autocast = (torch.autocast(self._device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        try:
            with torch.no_grad(), autocast:
                yield
        finally:
            self.model.train(was_training)

    def _continuation_logprobs(self, inputs: list[list[int]], lengths: list[int]) -> list[torch.Tensor]:
        """For each input, fp32 log-softmax [length, vocab] at its last ``length`` positions (those
        that predict the continuation). Rows are right-padded: causal attention never lets a real
        position see the padding after it."""
        width = max(len(row) for row in inputs)
        tokens = torch.full((len(inputs), width), self.eval_tokenizer.pad_id, dtype=torch.long)
        rows, cols = [], []
        for i, (row, length) in enumerate(zip(inputs, lengths)):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            rows.append(torch.full((length,), i, dtype=torch.long))
            cols.append(torch.arange(len(row) - length, len(row)))
        with self._inference():
            hidden = self.model.hidden_states(tokens.to(self._device))
            picked = hidden[torch.cat(rows).to(self._device), torch.cat(cols).to(self._device)]
            logprobs = self.model.head(picked).float().log_softmax(dim=-1)
        return list(logprobs.split(lengths))

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether greedy decoding gives the continuation)."""
        collator = Collator(requests, sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])),
                            group_by="contexts", group_fn=lambda req: req[-2] + req[-1][:-1])
        results: list[tuple[float, bool]] = []
        for chunk in collator.get_batched(n=self.batch_size, batch_fn=None):
            for _, context, continuation in chunk:
                if not context or not continuation or len(continuation) > self.max_length:
                    raise ValueError(f"a loglikelihood request needs a context and a continuation of at most "
                                     f"max_length={self.max_length} tokens (got {len(context)} and {len(continuation)})")
            inputs = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in chunk]
            lengths = [len(continuation) for _, _, continuation in chunk]
            for (strings, context, continuation), logprobs in zip(chunk, self._continuation_logprobs(inputs, lengths)):
                greedy = logprobs.argmax(dim=-1)
                for strings_, tokens, logprobs_ in collator.get_cache(
                    req_str=strings, cxt_toks=context, cont_toks=continuation, logits=logprobs[None]
                ):
                    target = torch.tensor(tokens, dtype=torch.long, device=self._device)
                    score = float(logprobs_[0, -len(tokens):].gather(-1, target[:, None]).sum())
                    answer = (score, bool((greedy[-len(tokens):] == target).all()))
                    results.append(answer)
                    if strings_ is not None:
                        self.cache_hook.add_partial("loglikelihood", strings_, answer)
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each document's whole loglikelihood over disjoint windows of ``max_length`` tokens (every
        token scored once, the first after the prefix token); all windows batched together."""
        windows: list[Request] = []
        counts: list[int] = []
        for (string,) in [request.args for request in requests]:
            pairs = [make_disjoint_window(pair) for pair in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += [(None, context, continuation) for context, continuation in pairs]
            counts.append(len(pairs))
        scores = self._loglikelihood_tokens(windows) if windows else []
        totals, start = [], 0
        for request, count in zip(requests, counts):
            total = sum(score for score, _ in scores[start : start + count])
            start += count
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when a task asks) continuations up to the first stop sequence,
        batched by generation settings, longest prompts first."""
        collator = Collator([request.args for request in requests],
                            sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
                            group_by="gen_kwargs", group_fn=lambda req: req[1])
        eos_text = self.eval_tokenizer.token_text(self.eot_token_id)
        results: list[str] = []
        for chunk in collator.get_batched(n=self.batch_size, batch_fn=None):
            contexts, all_kwargs = zip(*chunk)
            kwargs = dict(normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            new_tokens = kwargs.pop("max_gen_toks")
            room = self.max_length - new_tokens
            if room <= 0:
                raise ValueError(f"max_gen_toks={new_tokens} leaves no room for a prompt in max_length={self.max_length}")
            prompts = [self.tok_encode(context)[-room:] or [self.prefix_token_id] for context in contexts]
            with self._inference():
                output = generate(
                    self.model, prompts, new_tokens,
                    temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                    top_p=float(kwargs.get("top_p") or 1.0), top_k=kwargs.get("top_k"),
                    eos_token_id=self.eot_token_id, pad_token_id=self.eval_tokenizer.pad_id,
                    stop=self._stop_when_text_has(until),
                )
            for context, completion in zip(contexts, output.completions):
                text = postprocess_generated_text(self.tok_decode(completion), stop=until, think_end_token=None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
        return collator.get_original(results)

    def _stop_when_text_has(self, stops: list[str]):
        """The generator's ``stop``: a sequence is done once its decoded completion holds a stop string."""
        stops = [s for s in stops if s]

        def done(completions: torch.Tensor) -> torch.Tensor:
            texts = [self.tok_decode(row, skip_special_tokens=False) for row in completions.tolist()]
            return torch.tensor([any(s in text for s in stops) for text in texts], dtype=torch.bool)

        return done
