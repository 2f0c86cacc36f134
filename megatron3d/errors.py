"""User-facing errors: each carries one line saying what is wrong, the value, and the fix.

Entry points catch these, print the message and exit with code 2, so a user never sees a
traceback for bad input. Internal invariants use ``assert`` instead.
"""


class Megatron3dError(Exception):
    """Base class for errors caused by the user's input rather than a bug."""


class ConfigError(Megatron3dError):
    """A flag, YAML key or combination of them is invalid."""


class DataError(Megatron3dError):
    """A dataset file is missing, corrupt or inconsistent."""


class CheckpointError(Megatron3dError):
    """A checkpoint is missing, incomplete or does not fit the configured model."""
