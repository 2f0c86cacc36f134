"""The checks of the non-persistent (local or in-memory) checkpoint flags, kept apart from
``validation.py`` (which is full): the interval and the type come together, and 'local'
names its directory, before any process starts."""

from __future__ import annotations

from megatron3d.config import CheckpointConfig
from megatron3d.errors import ConfigError

_INTERVAL, _TYPE = "--non-persistent-save-interval", "--non-persistent-ckpt-type"
_DIR = "--non-persistent-local-ckpt-dir"


def check_non_persistent(ckpt: CheckpointConfig) -> None:
    """Raise ``ConfigError`` for a combination of the three flags that cannot work."""
    interval, kind = ckpt.non_persistent_save_interval, ckpt.non_persistent_ckpt_type
    if interval is not None and kind is None:
        raise ConfigError(f"{_INTERVAL} {interval} needs {_TYPE}: pass {_TYPE} memory (host "
                          f"memory, /dev/shm) or local with {_DIR} DIR, or drop {_INTERVAL}")
    if kind is not None and interval is None:
        raise ConfigError(f"{_TYPE} {kind} needs {_INTERVAL} N (how often to keep a state): "
                          f"pass it, or drop {_TYPE}")
    if kind == "local" and ckpt.non_persistent_local_ckpt_dir is None:
        raise ConfigError(f"{_TYPE} local needs {_DIR} DIR, a node-local directory (not a "
                          f"shared filesystem): pass it, or use {_TYPE} memory")
    if kind is None and ckpt.non_persistent_local_ckpt_dir is not None:
        raise ConfigError(f"{_DIR} {ckpt.non_persistent_local_ckpt_dir} is used only with "
                          f"{_TYPE} and {_INTERVAL}: pass them, or drop {_DIR}")
