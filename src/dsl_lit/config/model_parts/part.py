"""What every part of a model config is: the fields it reads, their checks, a phrase for messages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from data_contract.errors import ConfigError

if TYPE_CHECKING:
    from dsl_lit.config.model import ModelConfig


class ModelPart(Protocol):
    """A part of a model config (an attention kind, the routed experts, MTP, hyper-connections)."""

    FIELDS: ClassVar[tuple[str, ...]]
    """The ``ModelConfig`` fields it reads (beyond the ones every model has)."""
    DESCRIPTION: ClassVar[str]
    """What a model without it lacks, for messages: "... (family x, which has no <DESCRIPTION>)"."""

    def validate(self, cfg: ModelConfig, prefix: str) -> None:
        """Raise ConfigError naming ``<prefix>.<field>`` for a value of its fields it cannot be built with."""


def require_ints(cfg: ModelConfig, prefix: str, names: tuple[str, ...] | list[str], minimum: int = 1) -> None:
    """ConfigError naming the first of ``names`` that is not an integer of at least ``minimum``."""
    for name in names:
        value: Any = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            kind = "a positive integer" if minimum == 1 else "a non-negative integer"
            raise ConfigError(f"{prefix}.{name}={value!r} must be {kind}")
