"""The only module that knows about CUDA: device choice, backend and launcher environment.

Everything else asks this module for ``device()`` and the distributed backend, so the same code
runs on CPU with gloo (tests, laptops) and on GPUs with NCCL (clusters).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import resource
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from megatron3d import rendezvous
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
    addr = os.environ["MASTER_ADDR"].strip()
    try:  # the store's client would retry an unknown name until the rendezvous timeout
        socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise ConfigError(f"the launcher environment's MASTER_ADDR={addr!r} does not resolve "
                          f"({getattr(err, 'strerror', None) or err}): set it to the host name "
                          "or address of rank 0") from None


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


def gpu_count() -> int:
    """GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if accelerator_available() else 0


def ranks_per_gpu(env: LaunchEnv) -> int:
    """How many of this node's ranks share one GPU (1 on CPU): LOCAL_WORLD_SIZE (torchrun
    sets it) over the GPUs, rounded up; without it, what this rank's LOCAL_RANK shows."""
    gpus = gpu_count()
    if not gpus:
        return 1
    here = _env_int("LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in os.environ else 0
    return max(1, -(-max(here, env.local_rank + 1) // gpus))


def resolve_backend(requested: str | None, env: LaunchEnv) -> str:
    """The process group's backend: ``--distributed-backend`` (None: NCCL on GPUs, gloo on
    CPU), refused in one line where it cannot work. gloo carries CUDA tensors (all-reduce and
    broadcast on the device; ``mpu/comm.py`` runs everything else with those or through host
    memory), so with gloo several ranks may share one GPU; NCCL refuses that."""
    gpus = gpu_count()
    chosen = requested or ("nccl" if gpus else "gloo")
    if chosen == "nccl" and not gpus:
        raise ConfigError("--distributed-backend nccl needs CUDA GPUs and this machine has "
                          "none: use --distributed-backend gloo, or leave the flag out")
    sharing = ranks_per_gpu(env)
    if chosen == "nccl" and sharing > 1:
        raise ConfigError(f"NCCL cannot run two ranks on one GPU ({sharing} ranks per GPU on "
                          f"this node's {gpus} GPU(s)): launch at most {gpus} rank(s) per "
                          "node, or pass --distributed-backend gloo to share GPUs (slow; for "
                          "tests)")
    return chosen


def device(local_rank: int = 0) -> torch.device:
    """This rank's device: GPU ``local_rank`` modulo the GPUs (ranks outnumbering them share
    them, over gloo), or the CPU."""
    if accelerator_available():
        return torch.device("cuda", local_rank % gpu_count())
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


class ComputeSpans:
    """The seconds of each span between ``begin`` and ``end``, kept until ``take``, measured
    without waiting: on CUDA by timing events on the current stream (read in ``take``, which
    must follow a synchronize, such as the log line's); on CPU, where the processor is the
    device, by the calling thread's CPU time (why not the wall clock: training/straggler.py)."""

    def __init__(self, dev: torch.device) -> None:
        self._cuda = dev.type == "cuda"
        self._open: torch.cuda.Event | float | None = None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host: list[float] = []

    def begin(self) -> None:
        self._open = self._mark()

    def end(self) -> None:
        if self._cuda:
            self._events.append((self._open, self._mark()))
        else:
            self._host.append(time.thread_time() - self._open)

    def take(self) -> list[float]:
        """Each span's seconds since the last ``take``; on CUDA only once the device is
        synced."""
        taken = self._host + [a.elapsed_time(b) / 1000.0 for a, b in self._events]
        self._events, self._host = [], []
        return taken

    def _mark(self) -> torch.cuda.Event | float:
        if not self._cuda:
            return time.thread_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


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


class _Work(Protocol):
    """A collective in flight (``torch.distributed``'s work)."""

    def wait(self) -> object: ...


class HostRoundTrip:
    """A few host values taken to the device for a collective, and its result brought back,
    with neither the host nor the compute stream waiting for the device in between.

    ``send`` copies the values from pinned memory (no host wait); ``start`` queues the copy of
    the reduced tensor back into pinned memory on a side stream, behind the collective, and
    records an event; ``result`` waits for that event. Read a step after ``start``, the event
    has passed (or passes as the device ends that step, with the next step already queued), so
    the wait never drains the device's queue. On CPU the tensor already is host memory:
    ``result`` waits for the collective only. One round trip at a time: each buffer is reused
    once the previous ``result`` returned."""

    def __init__(self, numel: int, dev: torch.device) -> None:
        self._dev = dev
        self._outgoing = host_buffer((numel,), torch.float32)
        self._incoming = host_buffer((numel,), torch.float32)
        cuda = dev.type == "cuda"
        self._stream = torch.cuda.Stream(dev) if cuda else None
        self._event = torch.cuda.Event() if cuda else None
        self._pending: tuple[torch.Tensor, _Work | None] | None = None

    def send(self, values: Sequence[float]) -> torch.Tensor:
        """``values`` as a float32 tensor on the device."""
        host = torch.tensor(values, dtype=torch.float32)
        if self._stream is None:
            return host
        self._outgoing.copy_(host)  # the last copy out of it ended before the last result
        return self._outgoing.to(self._dev, non_blocking=True)

    def start(self, tensor: torch.Tensor, work: _Work | None) -> None:
        """Bring ``tensor`` back once ``work`` (None: nothing in flight) has written it."""
        assert self._pending is None, "a round trip is in flight: result() first"
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._dev))  # ``tensor`` made
            with torch.cuda.stream(self._stream):
                if work is not None:
                    work.wait()  # orders the side stream, not the host, after the collective
                self._incoming.copy_(tensor, non_blocking=True)
                self._event.record(self._stream)
            work = None
        self._pending = (tensor, work)  # ``tensor`` held until the side stream is done with it

    def result(self) -> list[float]:
        """The values ``start`` asked for, waiting for them if they are still on the way."""
        assert self._pending is not None, "nothing in flight: start() first"
        tensor, work = self._pending
        self._pending = None
        if self._event is not None:
            self._event.synchronize()
            tensor = self._incoming
        elif work is not None:
            work.wait()
        return tensor.numpy().tolist()  # host memory, already waited for: no device sync


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


def reset_peak_memory(dev: torch.device) -> int:
    """Start a window for ``peak_memory``; returns the bytes in use now: the GPU allocator's,
    or on CPU the process's resident set (Linux: the peak is reset through
    ``/proc/self/clear_refs``, so it then covers every allocation, not only torch's)."""
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return torch.cuda.memory_allocated(dev)
    _trim_heap()
    with contextlib.suppress(OSError):  # not Linux: the peak is the process's since start
        Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``), so a
    window starts from what is live, not from what an earlier phase freed but kept."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_memory(dev: torch.device) -> int:
    """The most bytes in use since ``reset_peak_memory``, counted as it counts them."""
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: the peak


def memory_capacity(env: LaunchEnv) -> int:
    """Bytes one rank can hold: its GPU's memory (shared by the ranks on that GPU), or on
    CPU this machine's memory shared by the ranks on it."""
    if accelerator_available():
        gpu = device(env.local_rank)
        return torch.cuda.get_device_properties(gpu).total_memory // ranks_per_gpu(env)
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


def init_process_group(env: LaunchEnv, timeout_minutes: float = 10.0,
                       backend: str | None = None,
                       rendezvous_timeout_s: float = 300.0) -> dist.Store:
    """Join the job's process group and return its key-value store (the launcher's, under
    torchrun), through which a failing rank tells the others to stop. A plain one-process run
    gets a private in-memory store, so the code path (groups, collectives) is the same as under
    torchrun. ``timeout_minutes`` bounds every collective (--distributed-timeout-minutes);
    ``backend`` is ``resolve_backend``'s answer (None: the device's default); joining waits at
    most ``rendezvous_timeout_s`` (--rendezvous-timeout), then raises ``ConfigError``."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not env.launched:
        store = dist.HashStore()
    else:
        store = rendezvous.join(env.rank, env.world_size, rendezvous_timeout_s)
        store.set_timeout(timeout)  # the store's later waits are the collectives' (peer stop)
    dist.init_process_group(backend or resolve_backend(None, env), store=store,
                            rank=env.rank, world_size=env.world_size, timeout=timeout)
    return store

