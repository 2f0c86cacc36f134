"""``scripts/local_nodes.sh``: N nodes on one machine, the real multi-node launch path.

The plan (namespaces, links, limits, commands) is checked without root. Two real launches
of 2 nodes x 2 ranks (root, ``ip``, ``tc`` and ``unshare`` needed, else skipped with the
reason) train the same model as one process:
- (TP, PP, DP) = (2, 1, 2), ZeRO-1, through scripts/slurm/launch.sh (``--slurm``): the
  SLURM scripts' host list, rendezvous and torchrun flags on real node addresses;
- (1, 2, 2), ZeRO-3, torchrun per node; a SIGTERM to one node's torchrun makes every rank
  stop at the same iteration and save a complete checkpoint, and the job exits 143 (what a
  launcher stopped by SIGTERM exits with, tools/launch.py).
Losses and grad norms (the log lines) and the saved checkpoint (weights and Adam moments)
must equal those of a single-process run of the same iterations (fp32 tolerances).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.tools import local_nodes
from megatron3d.tools.node_plan import (
    NodePlan,
    on_node,
    setup_commands,
    srun_script,
    stale_namespaces,
    torchrun_options,
)
from tests.helpers.preemption import ITER_LINE
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "local_nodes.sh"
TIMEOUT_S = 240.0  # 2 launchers and 4 ranks starting on a loaded 2-core machine
NEVER = "100000"
PLAN = NodePlan(owner=4242, nodes=2, ranks_per_node=2, rate="2gbit", port=29511)


# --- the plan, without root ---------------------------------------------------------------------

def test_each_node_link_is_limited_both_ways_and_loopback_is_not():
    commands = setup_commands(PLAN)
    limits = [c for c in commands if "tbf" in c]
    # (namespace, device) of each limit: the node's end and the switch's end of each link
    where = sorted((c[3], c[8]) for c in limits)
    assert where == [("m3d-4242-n0", "eth0"), ("m3d-4242-n1", "eth0"),
                     ("m3d-4242-sw", "n0"), ("m3d-4242-sw", "n1")]
    assert all(c[c.index("rate") + 1] == "2gbit" for c in limits)
    assert not any("lo" in c for c in limits)
    addresses = [c[c.index("add") + 1] for c in commands if "addr" in c]
    assert addresses == ["10.77.0.1/24", "10.77.0.2/24"]
    unlimited = NodePlan(4242, 2, 2, None, 29511)
    assert not any("tbf" in c for c in setup_commands(unlimited))
    assert PLAN.hosts_file().splitlines()[1:] == ["10.77.0.1 node0", "10.77.0.2 node1"]
    assert PLAN.nodelist == "node[0-1]"


def test_each_node_runs_torchrun_in_its_namespace_with_a_rendezvous_at_node0():
    assert on_node(PLAN, 1)[:4] == ["ip", "netns", "exec", "m3d-4242-n1"]
    assert on_node(PLAN, 1)[-1] == "node1"  # its host name
    options = torchrun_options(PLAN, 1, "job")
    pairs = dict(zip(options[::2], options[1::2], strict=True))
    assert pairs["--nnodes"] == "2" and pairs["--nproc-per-node"] == "2"
    assert pairs["--node-rank"] == "1" and pairs["--rdzv-backend"] == "c10d"
    assert pairs["--rdzv-endpoint"] == "node0:29511"


def test_only_namespaces_of_runs_that_are_gone_are_stale():
    listing = "m3d-4242-n0 (id: 1)\nm3d-4242-sw\nm3d-77-n1\nm3d-peers\nother\n"
    assert stale_namespaces(listing, alive={77}) == ["m3d-4242-n0", "m3d-4242-sw"]


def test_srun_starts_one_task_per_node(tmp_path):
    script = srun_script(PLAN, tmp_path)
    done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    for i in range(2):
        assert f"SLURM_NODEID={i} " in script and f"SLURMD_NODENAME=node{i} " in script
        assert f"m3d-4242-n{i}" in script and str(tmp_path / f"node{i}.pid") in script


def test_without_root_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert local_nodes.main(["--nodes", "2", "--ranks-per-node", "2", "--", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err, err


# --- real launches -------------------------------------------------------------------------------

def _unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [t for t in local_nodes.TOOLS if shutil.which(t) is None]
    return f"needs {', '.join(missing)}" if missing else ""


needs_root = pytest.mark.skipif(bool(_unavailable()), reason=_unavailable() or "ok")


class Launch:
    """``scripts/local_nodes.sh`` as a child, its output read as it comes."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        self.proc = subprocess.Popen(["bash", str(SCRIPT), *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: re.Pattern) -> re.Match:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            running = self.proc.poll() is None
            found = [m for m in map(pattern.search, list(self.lines)) if m]
            if found:
                return found[-1]
            if not running or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        raise AssertionError(f"never printed {pattern.pattern}:\n{self.output[-3000:]}")

    def finish(self) -> int:
        try:
            code = self.proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
            raise AssertionError(f"did not finish:\n{self.output[-3000:]}") from None
        self._reader.join(10)
        return code


def _losses(output: str) -> list[tuple[int, float, float]]:
    """(iteration, lm loss, grad norm) of each printed iteration line."""
    found = [ITER_LINE.match(line) for line in output.splitlines()]
    return [(int(m[1]), float(m[4]), float(m[5])) for m in found if m]


def _single_process(argv: list[str], capsys) -> list[tuple[int, float, float]]:
    capsys.readouterr()
    assert pretrain_gpt.main(argv) == 0
    return _losses(capsys.readouterr().out)


def _assert_same(run: list, reference: list, ckpt: Path, ref_ckpt: Path, iteration: int) -> None:
    assert [it for it, *_ in run] == [it for it, *_ in reference] == list(range(1, iteration + 1))
    torch.testing.assert_close(torch.tensor([r[1:] for r in run]),
                               torch.tensor([r[1:] for r in reference]), **FP32)
    got, want = (CheckpointReader(root / f"iter_{iteration:07d}") for root in (ckpt, ref_ckpt))
    assert got.meta["layout"]["world_size"] == 4
    for key in ("iteration", "consumed_samples", "adam_step"):
        assert got.meta[key] == want.meta[key], key
    for kind in ("weight", "exp_avg", "exp_avg_sq"):
        assert sorted(got.names(kind)) == sorted(want.names(kind)) != []
        for name in want.names(kind):
            torch.testing.assert_close(got.tensor(name, kind), want.tensor(name, kind), **FP32,
                                       msg=lambda m, n=name, k=kind: f"{n} {k}: {m}")


@needs_root
def test_zero1_tp2_dp2_through_the_slurm_launch_equals_one_process(tmp_path, capsys):
    argv = train_argv("gpt2", 4, *EQUIVALENCE_FLAGS, "--save-interval", "4")
    launch = Launch(["--nodes", "2", "--ranks-per-node", "2", "--master-port", "29531",
                     "--slurm", "--", "pretrain_gpt.py", *argv, "--zero-stage", "1",
                     "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "nodes")],
                    tmp_path)
    code = launch.finish()
    assert code == 0, launch.output[-3000:]
    assert "launch.sh: nodes node0 node1; rendezvous node0:29531" in launch.output
    reference = _single_process([*argv, "--save", str(tmp_path / "one")], capsys)
    _assert_same(_losses(launch.output), reference, tmp_path / "nodes", tmp_path / "one", 4)


NODE_PID = re.compile(r"node 1 \(node1, 10\.77\.0\.2, namespace (\S+)\): torchrun pid (\d+)")
STOPPING = re.compile(r"stopping at iteration (\d+)")


@needs_root
def test_zero3_pp2_dp2_sigterm_to_one_node_saves_everywhere(tmp_path, capsys):
    argv = train_argv("gpt2", int(NEVER), *EQUIVALENCE_FLAGS, "--save-interval", NEVER)
    launch = Launch(["--nodes", "2", "--ranks-per-node", "2", "--master-port", "29532", "--",
                     str(REPO / "pretrain_gpt.py"), *argv, "--zero-stage", "3",
                     "--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "nodes")],
                    tmp_path)
    node = launch.wait_for(NODE_PID)
    launch.wait_for(re.compile(r"^ iteration +3/"))
    os.kill(int(node[2]), signal.SIGTERM)  # that node's torchrun only
    code = launch.finish()
    assert code == 128 + signal.SIGTERM, launch.output[-3000:]
    stopped = int(launch.wait_for(STOPPING)[1])
    assert (tmp_path / "nodes" / "latest").read_text().strip() == str(stopped)
    assert not subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              check=False).stdout.count(node[1])  # cleaned up
    reference = _single_process([*argv, "--save", str(tmp_path / "one"), "--exit-interval",
                                 str(stopped)], capsys)
    # CheckpointReader checks that every rank's file is present and whole.
    _assert_same(_losses(launch.output), reference, tmp_path / "nodes", tmp_path / "one",
                 stopped)
