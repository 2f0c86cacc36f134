"""User-facing errors: each carries one line saying what is wrong, the value, and the fix.

Entry points catch these, print the message and exit with code 2 (1 for ``TrainingError``),
so a user never sees a traceback for bad input or a run that went wrong. Internal invariants
use ``assert`` instead.
"""


class Megatron3dError(Exception):
    """Base class for errors a user can act on (bad input, a run gone wrong), not bugs."""


class ConfigError(Megatron3dError):
    """A flag, YAML key or combination of them is invalid."""


class DataError(Megatron3dError):
    """A dataset file is missing, corrupt or inconsistent."""


class CheckpointError(Megatron3dError):
    """A checkpoint is missing, incomplete or does not fit the configured model."""


class TrainingError(Megatron3dError):
    """The run itself went wrong (non-finite gradients or weights), not its input: entry
    points exit 1 instead of 2."""
