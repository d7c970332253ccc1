"""Errors raised for bad user input, before any heavy work or process group starts."""


class ConfigError(ValueError):
    """A config value is invalid. The message names the field (e.g. ``optim.lr``) and the fix."""


class MissingInputError(ConfigError, FileNotFoundError):
    """A file or directory the user named is missing, incomplete or not what it should be: a config
    error (one line, exit 2 in a recipe) that callers may still catch as ``FileNotFoundError``."""
