"""The only module that knows about CUDA: device choice, backend and launcher environment.

Everything else asks this module for ``device()`` and the distributed backend, so the same code
runs on CPU with gloo (tests, laptops) and on GPUs with NCCL (clusters).
"""

from __future__ import annotations

import datetime
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron3d.errors import ConfigError

# Dense bf16 peak TFLOP/s per GPU, used for MFU when --peak-tflops is not given.
_PEAK_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun, SLURM + torchrun, or nothing) told this process."""

    rank: int
    world_size: int
    local_rank: int
    launched: bool  # False: a plain `python pretrain_gpt.py` with one process


def launch_env() -> LaunchEnv:
    """The launcher's RANK, WORLD_SIZE and LOCAL_RANK; ``ConfigError`` when they make no
    sense, since the process group would otherwise fail with a traceback or wait forever."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        return LaunchEnv(rank=0, world_size=1, local_rank=0, launched=False)
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if rank >= world_size:
        raise ConfigError(f"this process's rank is outside the job (RANK={rank}, "
                          f"WORLD_SIZE={world_size}): launch with torchrun, or set RANK to "
                          f"0..{world_size - 1}")
    return LaunchEnv(rank=rank, world_size=world_size, local_rank=local_rank, launched=True)


def check_rendezvous_env(env: LaunchEnv) -> None:
    """MASTER_ADDR and MASTER_PORT, which the env:// rendezvous of a launched run reads
    (torchrun sets both): ``ConfigError`` instead of a traceback in the rendezvous."""
    if not env.launched:
        return
    if not os.environ.get("MASTER_ADDR", "").strip():
        raise ConfigError("the launcher environment has WORLD_SIZE but no MASTER_ADDR: launch "
                          "with torchrun, or set MASTER_ADDR to the host of rank 0")
    port = os.environ.get("MASTER_PORT", "")
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"invalid launcher environment variable (MASTER_PORT={port!r}): "
                          "expected a port number in 1..65535; launch with torchrun, or set "
                          "MASTER_PORT to a free port on the host of rank 0")


def _env_int(name: str, low: int) -> int:
    """Environment variable ``name`` (``0`` when unset) as a whole number >= ``low``."""
    raw = os.environ.get(name, "0")
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low:
        raise ConfigError(f"invalid launcher environment variable ({name}={raw!r}): expected a "
                          f"whole number >= {low}; launch with torchrun, or unset WORLD_SIZE, "
                          "RANK and LOCAL_RANK for one process")
    return value


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def backend() -> str:
    return "nccl" if accelerator_available() else "gloo"


def device(local_rank: int = 0) -> torch.device:
    if accelerator_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_device(local_rank: int) -> torch.device:
    dev = device(local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def synchronize(dev: torch.device) -> None:
    """Wait for queued kernels; only called at log boundaries and in benchmarks."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def stream_marker(dev: torch.device) -> Callable[[], Callable[[], bool]] | None:
    """For a device whose host runs ahead (CUDA: a collective call returns once queued), a
    function that marks the current stream now and returns whether the device has passed the
    mark (an event and its query, which never waits); None on CPU, where a call that returned
    is done."""
    if dev.type != "cuda":
        return None

    def mark() -> Callable[[], bool]:
        event = torch.cuda.Event()
        event.record()
        return event.query

    return mark


def backend_trace_writer(dump_dir: Path, rank: int) -> Callable[[], Path] | None:
    """torch's own flight recorder of NCCL collectives, for dumping beside the hang dumps: a
    function that writes its trace where torch writes it on a collective timeout
    ($TORCH_FR_DUMP_TEMP_FILE or $TORCH_NCCL_DEBUG_INFO_TEMP_FILE, then the rank; by default
    DUMP_DIR/nccl_trace_rank_RANK), so that `torchfrtrace` reads both kinds alike. None unless
    the process group runs NCCL and this torch can dump the trace."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return None
    dump = getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_nccl_trace", None)
    if dump is None:
        return None
    prefix = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
              or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
              or str(dump_dir / "nccl_trace_rank_"))
    path = Path(prefix + str(rank))

    def write() -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(dump())
        tmp.replace(path)  # whole or absent, as the hang dumps
        return path

    return write


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Host memory that device -> host copies fill while the device runs on: pinned
    (page-locked, so ``copy_(non_blocking=True)`` into it is a DMA the host need not wait for)
    when an accelerator is present, plain memory on CPU. torch's pinned allocator rounds the
    size up to a power of two; callers allocate once and reuse."""
    return torch.empty(shape, dtype=dtype, pin_memory=accelerator_available())


def peak_tflops(dev: torch.device) -> float | None:
    """Known dense bf16 peak of the device, or None (CPU, unknown GPU)."""
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in _PEAK_BF16_TFLOPS.items() if k in name), None)


def allocated_bytes() -> int | None:
    """Bytes the accelerator's allocator holds now, or None on CPU."""
    return torch.cuda.memory_allocated() if accelerator_available() else None


def memory_in_use(dev: torch.device) -> dict[str, float]:
    """Memory figures for TensorBoard, read from the allocator without a device sync: the
    GPU allocator's current, peak and reserved bytes, or on CPU the process's peak RSS."""
    if dev.type == "cuda":
        return {"mem-allocated-bytes": float(torch.cuda.memory_allocated(dev)),
                "mem-max-allocated-bytes": float(torch.cuda.max_memory_allocated(dev)),
                "mem-reserved-bytes": float(torch.cuda.memory_reserved(dev))}
    return {"mem-max-rss-bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                       * 1024)}  # Linux reports KiB


def memory_capacity(env: LaunchEnv) -> int:
    """Bytes one rank can hold: its GPU's memory, or on CPU this machine's memory shared by
    the ranks on it."""
    if accelerator_available():
        return torch.cuda.get_device_properties(env.local_rank).total_memory
    shared = env.launched and "LOCAL_WORLD_SIZE" in os.environ
    ranks_here = _env_int("LOCAL_WORLD_SIZE", 1) if shared else 1
    return host_memory_bytes() // ranks_here


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def describe(dev: torch.device) -> str:
    """One line naming the machine, printed by benchmarks next to their ratios."""
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__})"
    return f"CPU x{os.cpu_count()} threads={torch.get_num_threads()} (torch {torch.__version__})"


def init_process_group(env: LaunchEnv, timeout_minutes: float = 10.0) -> dist.Store:
    """Join the job's process group and return its key-value store (the launcher's, under
    torchrun), through which a failing rank tells the others to stop. A plain one-process run
    gets a private in-memory store, so the code path (groups, collectives) is the same as under
    torchrun. ``timeout_minutes`` bounds every collective (--distributed-timeout-minutes)."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not env.launched:
        store = dist.HashStore()
    else:
        store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size,
                                           timeout=timeout))
    dist.init_process_group(backend(), store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout)
    return store
