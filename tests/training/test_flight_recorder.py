"""The flight recorder, the dump format, the report's reasoning and the watchdog, without a
job: synthetic groups, hand-made dumps, and a watchdog in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from megatron3d.mpu.state import AxisGroup
from megatron3d.pipeline.instructions import Backward, Exchange, Forward
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.resilience.hang_dump import dump_path, read_dump, write_dump
from megatron3d.resilience.hang_report import analyse, format_report
from megatron3d.resilience.watchdog import (
    HANG_EXIT_CODE,
    PHASES,
    STARTUP,
    Watchdog,
    default_dump_dir,
)

ROOT = Path(__file__).resolve().parents[2]
TP = AxisGroup(group=object(), rank=0, size=2, ranks=(0, 1), name="tp")
DP = AxisGroup(group=object(), rank=0, size=2, ranks=(0, 2), name="dp")
PP = AxisGroup(group=object(), rank=0, size=2, ranks=(0, 4), name="pp")


def test_sequence_numbers_per_group_and_per_peer():
    rec = FlightRecorder(size=100)
    x = torch.zeros(3, 2, dtype=torch.bfloat16)
    for axis in (TP, DP, TP):
        rec("all_reduce", x, axis)
    rec("send", x, PP, 4, ("F", 0))
    rec("recv", x, PP, 4, ("B", 0))
    rec("send", x, PP, 4, ("F", 1))
    ops = rec.snapshot()
    assert [(o["group"], o["kind"], o["group_seq"]) for o in ops] == [
        ("tp", "all_reduce", 0), ("dp", "all_reduce", 0), ("tp", "all_reduce", 1),
        ("pp", "send", 0), ("pp", "recv", 0), ("pp", "send", 1)]
    assert ops[0]["shape"] == [3, 2] and ops[0]["dtype"] == "bfloat16"
    assert ops[5]["peer"] == 4 and ops[5]["tag"] == ["F", 1] and ops[5]["seq"] == 5


def test_ring_keeps_the_newest():
    rec = FlightRecorder(size=4)
    for _ in range(10):
        rec("all_reduce", torch.zeros(1), TP)
    assert [o["group_seq"] for o in rec.snapshot()] == [6, 7, 8, 9]


def test_instruction_context_follows_the_program():
    rec = FlightRecorder(size=10)
    program = [Forward(0), Exchange(send_forward=0, recv_backward=0), Backward(0)]
    rec.iteration = 7
    rec.begin(program)
    rec("all_reduce", torch.zeros(1), TP)  # inside F0
    rec.after(program[0])
    rec.after(object())  # a host callback spliced into the program is not an instruction
    rec("send", torch.zeros(1), PP, 4, ("F", 0))
    rec.after(program[1])
    rec.after(program[2])
    rec.end()
    rec("all_reduce", torch.zeros(1), DP)  # the optimizer, after the program
    ops = rec.snapshot()
    assert [(o["iteration"], o["program"], o["step"], o["instruction"]) for o in ops] == [
        (7, 1, 0, "F0"), (7, 1, 1, "X(send F0, recv B0)"), (7, 1, None, "-")]


def _dump(tmp: Path, rank: int, ops: list[dict], sizes=None, coords=None) -> None:
    sizes = sizes or {"tp": 1, "pp": 1, "dp": 3}
    write_dump(dump_path(tmp, rank), {
        "reason": "test", "rank": rank, "world_size": 3, "sizes": sizes,
        "coords": coords or {"tp": 0, "pp": 0, "dp": rank}, "iteration": 4,
        "phase": "training", "job": "j"}, ops)


def _ops(rank: int, kinds: list[str], shapes: list[list[int]] | None = None) -> list[dict]:
    """Blocking collectives on CPU: each but the last returned (done); the rank is blocked in
    the last one."""
    axis = AxisGroup(group=object(), rank=rank, size=3, ranks=(0, 1, 2), name="dp")
    rec = FlightRecorder(size=100)
    for i, kind in enumerate(kinds):
        rec(kind, torch.zeros(shapes[i] if shapes else [4]), axis)
        if i < len(kinds) - 1:
            rec.posted([None])
    return rec.snapshot()


def test_report_names_the_rank_that_issued_a_different_collective(tmp_path):
    for rank in range(3):
        _dump(tmp_path, rank, _ops(rank, ["all_reduce", "broadcast" if rank == 1 else
                                          "all_reduce", "all_reduce"]))
    report = format_report(analyse({r: read_dump(dump_path(tmp_path, r)) for r in range(3)}), [])
    assert "dp group [0, 1, 2]: members disagree at #1" in report
    culprits = [line.strip() for line in report.split("likely culprits:")[1].splitlines()[1:]]
    assert culprits == ["rank 1 (tp 0, pp 0, dp 1): issued a different operation at dp group "
                        "[0, 1, 2] #1"], report


def test_report_names_the_rank_behind_and_the_missing_one(tmp_path):
    _dump(tmp_path, 0, _ops(0, ["all_reduce"] * 3))
    _dump(tmp_path, 1, _ops(1, ["all_reduce"] * 2))  # rank 2 wrote nothing
    report = format_report(analyse({r: read_dump(dump_path(tmp_path, r)) for r in (0, 1)}), [])
    assert ("rank 0 waits in dp group [0, 1, 2] #2 (all_reduce [4] float32, iteration 0, -) "
            "for rank 1 (has not issued it: its last is #1); rank 2 (wrote no dump)") in report
    culprits = [line.strip() for line in report.split("likely culprits:")[1].splitlines()[1:]]
    assert culprits[0].startswith("rank 2 (tp 0, pp 0, dp 2): wrote no dump"), report
    assert culprits[1].startswith("rank 1 (tp 0, pp 0, dp 1): behind its peers"), report


def test_dump_is_readable_and_complete(tmp_path):
    _dump(tmp_path, 0, _ops(0, ["all_reduce"]))
    text = dump_path(tmp_path, 0).read_text()
    assert "== python stacks ==" in text and "in test_dump_is_readable_and_complete" in text
    assert read_dump(dump_path(tmp_path, 0))["ops"][0]["kind"] == "all_reduce"


def test_default_dump_dir():
    assert default_dump_dir(None, "/ckpt") == Path("/ckpt/hang")
    assert default_dump_dir(None, None) == Path("hang")
    assert default_dump_dir("/d", "/ckpt") == Path("/d")


def _watchdog(tmp: Path, timeout: float, **budgets: float) -> Watchdog:
    return Watchdog(FlightRecorder(8), tmp, rank=5, sizes={"tp": 2, "pp": 2, "dp": 2},
                    coords={"tp": 1, "pp": 0, "dp": 0}, timeout=timeout,
                    budgets={**dict.fromkeys(PHASES, 60.0), **budgets})


def test_sigusr2_dumps_without_stopping(tmp_path):
    dog = _watchdog(tmp_path, timeout=0).start()
    try:
        dog.recorder("all_reduce", torch.zeros(2), TP)
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not dump_path(tmp_path, 5).exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        dog.stop()
    data = read_dump(dump_path(tmp_path, 5))
    assert data["reason"].startswith("SIGUSR2") and data["coords"] == {"tp": 1, "pp": 0, "dp": 0}
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # restored


def test_each_phase_gets_its_own_allowance(tmp_path):
    dog = _watchdog(tmp_path, timeout=5, **{STARTUP: 30.0, "checkpoint load": 200.0,
                                            "evaluation": 100.0})
    assert 25 < dog._limit[0] - time.monotonic() <= 30 and dog._limit[2] == (
        "--hang-first-step-timeout")
    with dog.allowance("checkpoint load"):
        assert dog.phase == "checkpoint load" and dog._limit[1:] == (200.0,
                                                                      "--hang-load-timeout")
    # A rank done loading early may wait for a slower peer's load: its allowance stands.
    assert dog.phase == STARTUP and dog._limit[1:] == (200.0, "--hang-load-timeout")
    dog.beat(1)
    assert dog._limit[0] < time.monotonic() + 6 and dog.phase == "training"
    with dog.allowance("evaluation"):
        assert dog._limit[1:] == (100.0, "--hang-eval-timeout")
    assert dog.phase == "training" and dog._limit[2] == "--hang-eval-timeout"
    dog.beat(2)  # every rank passed the evaluation: back to the step's allowance
    assert dog._limit[1:] == (5, "--hang-timeout")


def test_watchdog_fires_while_the_main_thread_is_blocked(tmp_path):
    """The main thread blocks in C (a read on a pipe nobody writes to), as in a collective:
    the watchdog still dumps every thread's stack and exits the process with its code."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import megatron3d.resilience.watchdog as w
        from pathlib import Path
        from megatron3d.resilience.flight_recorder import FlightRecorder
        w.EXIT_GRACE_S = 0.0
        dog = w.Watchdog(FlightRecorder(4), Path({str(tmp_path)!r}), 0, {{"tp": 1, "pp": 1,
                         "dp": 1}}, {{"tp": 0, "pp": 0, "dp": 0}}, 1.0,
                         dict.fromkeys(w.PHASES, 1.0)).start()
        dog.beat(3)
        read_end, _ = os.pipe()
        os.read(read_end, 1)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == HANG_EXIT_CODE, done.stderr
    assert "nothing finished for 1 s during training (--hang-timeout)" in done.stderr
    data = read_dump(dump_path(tmp_path, 0))
    assert data["iteration"] == 3 and data["main_stack"][-1].endswith("in <module>")
    assert 'File "<string>"' in dump_path(tmp_path, 0).read_text().split("== python stacks")[1]


def test_a_dump_brings_the_backends_trace_beside_it(tmp_path):
    """Both records exist: ours, and torch's flight recorder of NCCL collectives. A failure
    to write torch's never costs ours."""
    written = tmp_path / "nccl_trace_rank_5"

    def trace() -> Path:
        written.write_bytes(b"trace")
        return written

    dog = _watchdog(tmp_path, timeout=0)
    dog.trace = trace
    assert dog.dump("test") == dump_path(tmp_path, 5) and written.read_bytes() == b"trace"

    def failing() -> Path:
        raise RuntimeError("no trace")

    dog.trace = failing
    dump_path(tmp_path, 5).unlink()
    assert dog.dump("test").exists()


def test_the_nccl_trace_is_written_where_torch_writes_it(tmp_path, monkeypatch):
    from megatron3d import device

    assert device.backend_trace_writer(tmp_path, 3) is None  # no process group
    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(device.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(device.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda: b"pickled", raising=False)
    assert device.backend_trace_writer(tmp_path, 3) is None  # only NCCL's
    monkeypatch.setattr(device.dist, "get_backend", lambda: "nccl")
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert device.backend_trace_writer(tmp_path, 3)() == tmp_path / "nccl_trace_rank_3"
    assert (tmp_path / "nccl_trace_rank_3").read_bytes() == b"pickled"
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(tmp_path / "elsewhere" / "t_"))
    assert device.backend_trace_writer(tmp_path, 3)() == tmp_path / "elsewhere" / "t_3"
    monkeypatch.delattr(c10d, "_dump_nccl_trace")
    assert device.backend_trace_writer(tmp_path, 3) is None  # a torch without it
