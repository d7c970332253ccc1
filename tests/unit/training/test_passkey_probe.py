"""``eval.passkey``: retrieval measured inside the training loop, a run stopped at the first probe
that retrieves ``stop_at`` of its prompts, training left exactly as it was, bad options refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from data_contract.errors import ConfigError
from dsl_lit.config import TrainConfig
from dsl_lit.config.eval import PasskeyProbeConfig
from dsl_lit.evaluation.passkey import passkey_outcomes
from dsl_lit.training.callbacks.passkey_probe import PasskeyProbe
from tests.conftest import compose_config, scratch_dir
from tests.passkey_models import Retriever, word_tokenizer


class LearnsToRetrieve(Retriever):
    """Misses every key until it is told it has learnt; draws from torch's generator on every
    forward (as dropout would), so a probe that did not restore the generators would show."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        torch.rand(1)
        return super().forward(tokens)


class Module(L.LightningModule):
    """One weight trained by SGD; ``model`` retrieves from optimizer step ``learns_at`` on."""

    def __init__(self, model: LearnsToRetrieve, learns_at: int) -> None:
        super().__init__()
        self.model, self.learns_at = model, learns_at
        self.runner = SimpleNamespace(shards_model=False)  # one process holds the whole model
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.draws: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.draws.append(float(torch.rand(1)))  # what training draws, probe or no probe
        self.model.wrong = batch_idx + 1 < self.learns_at  # after this step: global_step = batch_idx + 1
        return (self.weight * batch.float().mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    directory = scratch_dir(request, "tokenizer")
    word_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def fit(tokenizer_dir: Path, stop_at: float | None, max_steps: int = 12,
        probe: bool = True) -> tuple[L.Trainer, Module, PasskeyProbe]:
    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    module = Module(LearnsToRetrieve(tokenizer, wrong=True), learns_at=6)
    callback = PasskeyProbe(PasskeyProbeConfig(every_n_steps=2, per_depth=2, stop_at=stop_at).validate(),
                            length=96, tokenizer_dir=str(tokenizer_dir))
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback] if probe else [])
    trainer.fit(module, DataLoader(torch.arange(64), batch_size=4))
    return trainer, module, callback


def test_the_run_stops_at_the_first_probe_that_retrieves_stop_at(tokenizer_dir: Path) -> None:
    trainer, module, probe = fit(tokenizer_dir, stop_at=0.5)
    assert probe.history == [(2, 0.0), (4, 0.0), (6, 1.0)]
    assert trainer.global_step == 6 and len(module.draws) == 6


def test_a_stopped_run_resumed_trains_no_further_unless_stop_at_is_raised(tokenizer_dir: Path) -> None:
    trainer, module, probe = fit(tokenizer_dir, stop_at=0.5)
    checkpoint = tokenizer_dir.parent / "stopped.ckpt"
    trainer.save_checkpoint(checkpoint)

    def resume(stop_at: float | None) -> tuple[L.Trainer, Module, PasskeyProbe]:
        again = Module(LearnsToRetrieve(word_tokenizer(), wrong=True), learns_at=0)  # retrieves from the start
        callback = PasskeyProbe(PasskeyProbeConfig(every_n_steps=2, per_depth=2, stop_at=stop_at).validate(),
                                length=96, tokenizer_dir=str(tokenizer_dir))
        resumed = L.Trainer(max_steps=12, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
        resumed.fit(again, DataLoader(torch.arange(64), batch_size=4), ckpt_path=checkpoint)
        return resumed, again, callback

    resumed, again, callback = resume(stop_at=0.5)
    assert resumed.global_step == 6 and again.draws == [] and callback.history == probe.history
    resumed, again, callback = resume(stop_at=None)  # the stop dropped: trains on to max_steps
    assert resumed.global_step == 12 and len(again.draws) == 6 and callback.history[-1] == (12, 1.0)


def test_without_stop_at_the_probe_only_measures_and_leaves_training_as_it_was(tokenizer_dir: Path) -> None:
    trainer, module, probe = fit(tokenizer_dir, stop_at=None, max_steps=8)
    assert probe.history == [(2, 0.0), (4, 0.0), (6, 1.0), (8, 1.0)] and trainer.global_step == 8
    _, unprobed, _ = fit(tokenizer_dir, stop_at=None, max_steps=8, probe=False)
    assert module.draws == unprobed.draws  # the probe's 20 forwards per probe drew nothing training sees
    assert module.model.training  # back in training mode


class Alternating(LearnsToRetrieve):
    """Right on every other prompt it is shown."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        logits = super().forward(tokens)
        return logits if self.calls % 2 else torch.zeros_like(logits)


def test_the_probe_scores_the_prompts_recipes_passkey_scores_with_its_seed(tokenizer_dir: Path) -> None:
    tokenizer = word_tokenizer()
    probe = PasskeyProbe(PasskeyProbeConfig(every_n_steps=1, per_depth=3, seed=7, depths=[0.0, 1.0]),
                         length=128, tokenizer_dir=str(tokenizer_dir))
    probe.setup(None, None, "fit")  # type: ignore[arg-type]
    module = SimpleNamespace(model=Alternating(tokenizer), runner=SimpleNamespace(shards_model=False),
                             device=torch.device("cpu"))
    direct = passkey_outcomes(Alternating(tokenizer), tokenizer, [128], [0.0, 1.0], per_depth=3, seed=7)
    assert [hit for hits in direct[128].values() for hit in hits] == [True, False] * 3
    assert probe.probe(module) == 0.5 and module.model.calls == 6


@pytest.mark.parametrize("overrides, message", [
    (["eval.passkey.stop_at=0.5"], "eval.passkey.stop_at=0.5 needs a share in (0, 1] and eval.passkey.every_n_steps > 0"),
    (["eval.passkey.every_n_steps=10", "eval.passkey.stop_at=1.5"], "eval.passkey.stop_at=1.5 needs a share"),
    (["eval.passkey.every_n_steps=10", "eval.passkey.length=4096"],
     "eval.passkey.length=4096 exceeds model.max_seq_len=1024"),
    (["eval.passkey.every_n_steps=10", "eval.passkey.per_depth=0"], "eval.passkey.per_depth=0 must be at least 1"),
    (["eval.passkey.every_n_steps=-1"], "eval.passkey.every_n_steps=-1 must be >= 0"),
])
def test_bad_probe_options_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        TrainConfig.from_hydra(compose_config("pretrain", ["model=deepseek_v3_tiny", *overrides]))
    assert message in str(error.value)
