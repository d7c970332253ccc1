"""Errors raised for bad user input, before any heavy work or process group starts."""


class ConfigError(ValueError):
    """A config value is invalid. The message names the field (e.g. ``optim.lr``) and the fix."""
