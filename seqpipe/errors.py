"""Errors shared by modules that must not import each other."""


class TopologyError(RuntimeError):
    """libtpu or JAX's CUDA plugin cannot describe the slice or system (not installed, or too
    old); the message says so."""


class DataError(ValueError):
    """Bad data or data config; the message says what is wrong and how to fix it."""


class RestoreError(RuntimeError):
    """No checkpoint in the workdir restores; the message is one line."""


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key and what would be valid."""


class TrainingError(RuntimeError):
    """Training cannot go on (for example a non-finite loss); the message says why."""
