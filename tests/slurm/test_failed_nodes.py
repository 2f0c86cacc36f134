"""What launch.sh does after its job step: the failed-node list, requeue and exclusion.

Real Slurm cannot fail a chosen node of a multi-node job here, so these run launch.sh (through
cpu_tiny.slurm) for a fake two-node allocation with fake ``srun``, ``scontrol``, ``sbatch`` and
``scancel`` on PATH: the fake srun plays the step (each node's ``tools/launch.py`` record,
signals to the batch shell, the exit code) and the others log how they were called.
``test_local_slurm.py`` runs the same path on a real Slurm with real workers.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron3d.resilience import node_exit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "cpu_tiny.slurm"
NODES = ["gpu001", "gpu002"]

# show hostnames: plain comma lists and one bracket group; show job -o: $FAKE_JOB_LINE.
FAKE_SCONTROL = r'''#!PYTHON
import os
import re
import sys

with open(os.environ["FAKE_LOG"], "a") as log:
    log.write("scontrol " + " ".join(sys.argv[1:]) + "\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", sys.argv[3]):
        head, _, ranges = item.partition("[")
        for part in ranges.rstrip("]").split(",") if ranges else [""]:
            low, _, high = part.partition("-")
            for i in range(int(low or 0), int(high or low or 0) + 1):
                print(f"{head}{i:0{len(low)}d}" if low else head)
elif sys.argv[1:3] == ["show", "job"]:
    print(os.environ["FAKE_JOB_LINE"])
'''
FAKE_SBATCH = r'''#!/bin/bash
echo "sbatch $* SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT-unset}" >> "$FAKE_LOG"
echo "777;cluster"
'''
FAKE_LOGGER = '''#!/bin/sh
echo "NAME $*" >> "$FAKE_LOG"
'''


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


class Job:
    """One fake allocation of NODES running cpu_tiny.slurm with a scripted step."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir()
        self.log = root / "calls.log"
        self.run_dir = root / "run"
        self.failed = self.run_dir / "failed_nodes.txt"
        _executable(self.bin / "scontrol", FAKE_SCONTROL.replace("PYTHON", sys.executable, 1))
        _executable(self.bin / "sbatch", FAKE_SBATCH)
        _executable(self.bin / "scancel", FAKE_LOGGER.replace("NAME", "scancel"))
        _executable(self.bin / "python3", "#!/bin/sh\nexit 0\n")  # "can python3 import torch"
        self.job_line = (f"JobId=12345 JobName=cpu_tiny ExcNodeList=(null) Command={SCRIPT} "
                         f"WorkDir={root} StdOut={root}/cpu_tiny-12345.out "
                         f"StdErr={root}/cpu_tiny-12345.out TimeLimit=00:30:00 Partition=debug "
                         "Account=(null) QOS=normal")

    def run(self, step: str, **env: str) -> subprocess.CompletedProcess:
        """launch.sh with ``step`` as the srun step's body (bash, $PPID the batch shell)."""
        _executable(self.bin / "srun", f"#!/bin/bash\n{step}\n")
        full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
        full.update(PATH=f"{self.bin}:/usr/bin:/bin", HOME=str(self.root), VENV="none",
                    MEGATRON3D_DIR=str(REPO), RUN_DIR=str(self.run_dir), FAKE_LOG=str(self.log),
                    FAKE_JOB_LINE=self.job_line, SLURM_JOB_ID="12345", SLURM_JOB_NAME="cpu_tiny",
                    SLURM_NNODES="2", SLURM_JOB_NODELIST=",".join(NODES), **env)
        # Files, not pipes: launch.sh's SIGUSR1 resender leaves a `sleep 20` holding its output.
        out, err = self.root / "stdout", self.root / "stderr"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            done = subprocess.run(["bash", str(SCRIPT)], env=full, stdout=stdout,
                                  stderr=stderr, timeout=60, check=False)
        return subprocess.CompletedProcess(done.args, done.returncode, out.read_text(),
                                           err.read_text())

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def failed_lines(self) -> list[list[str]]:
        return [line.split() for line in self.failed.read_text().splitlines()]


def records(*lines: str, code: int) -> str:
    """A step in which each node's launcher writes ``TIME NODE CODE RANK`` and srun exits."""
    writes = [f"echo {shlex.quote(line)} > \"$MEGATRON3D_NODE_EXIT_DIR/{line.split()[1]}.1\""
              for line in lines]
    return "\n".join([*writes, f"exit {code}"])


@pytest.fixture
def job(tmp_path: Path) -> Job:
    return Job(tmp_path)


def test_the_node_that_failed_first_is_recorded_and_the_job_requeued(job: Job) -> None:
    # gpu002's launcher gave up first (rank 5 killed); gpu001's workers failed after it.
    done = job.run(records("1700000000000200 gpu001 1 0", "1700000000000100 gpu002 137 5",
                           code=137))
    assert done.returncode == 137, done.stderr
    [line] = job.failed_lines()
    assert line[:5] == ["gpu002", "job=12345.0", "code=137", "rank=5", "latest=none"], line
    assert "node gpu002 failed first (exit 137, rank 5)" in done.stdout
    assert "requeueing job 12345" in done.stdout
    assert job.calls()[-1] == "scontrol requeue 12345"
    assert not (job.run_dir / "checkpoints" / "node_exits").exists()


def test_a_node_that_failed_twice_is_excluded_on_resubmission(job: Job) -> None:
    job.run_dir.mkdir()
    job.failed.write_text("gpu002 job=9.0 code=1 rank=4 latest=none time=then\ngpu001\n")
    done = job.run(records("1700000000000100 gpu002 134 6", code=134), SLURM_RESTART_COUNT="1")
    assert done.returncode == 134, done.stderr
    [sbatch] = [call for call in job.calls() if call.startswith("sbatch")]
    args = sbatch.split()
    assert {"--exclude=gpu002", "--dependency=afterany:12345", "--nodes=2",
            "--job-name=cpu_tiny", f"--output={job.root}/cpu_tiny-12345.out",
            "--time=00:30:00", "--partition=debug", "--qos=normal", f"--chdir={job.root}",
            str(SCRIPT)} <= set(args), sbatch
    assert not any(a.startswith("--account") for a in args)
    assert args[-1] == "SLURM_RESTART_COUNT=unset"  # the new job's own Slurm variables
    assert not any("requeue" in call for call in job.calls())
    named = [ln for ln in done.stdout.splitlines() if "excluding" in ln]
    assert len(named) == 1 and "excluding node(s) gpu002 (failed twice" in named[0], done.stdout
    assert "resubmitted as job 777" in named[0]

    # Once the job excludes it (the resubmitted one), a further failure just requeues.
    job.job_line = job.job_line.replace("ExcNodeList=(null)", "ExcNodeList=gpu[002]")
    job.log.unlink()
    done = job.run(records("1700000000000100 gpu002 1 3", code=1), REQUEUE_ON_FAILURE="5")
    assert job.calls()[-1] == "scontrol requeue 12345", done.stdout


def test_bad_input_names_no_node_and_is_not_requeued(job: Job) -> None:
    done = job.run(records("1700000000000100 gpu001 2 0", "1700000000000300 gpu002 2 2",
                           code=2))
    assert done.returncode == 2
    assert not job.failed.exists()
    assert "bad input (exit 2, rank 0)" in done.stdout and "not requeueing" in done.stdout
    assert not any("requeue" in call or "sbatch" in call for call in job.calls())


def test_without_records_every_node_of_the_step_is_recorded(job: Job) -> None:
    done = job.run("exit 1")
    assert done.returncode == 1
    assert [line[0] for line in job.failed_lines()] == NODES
    assert {line[2] for line in job.failed_lines()} == {"code=1"}
    assert job.calls()[-1] == "scontrol requeue 12345"


@pytest.mark.parametrize(("requeues", "earlier_at", "requeued"), [
    ("2", "latest=10", False),  # the third failed run at checkpoint 10
    ("2", "latest=5", True),    # the checkpoint advanced since those failures
    ("0", None, False),         # requeue after a failure turned off
])
def test_requeue_after_failure_is_bounded(job: Job, requeues: str, earlier_at: str | None,
                                          requeued: bool) -> None:
    (job.run_dir / "checkpoints").mkdir(parents=True)
    (job.run_dir / "checkpoints" / "latest").write_text("10\n")
    if earlier_at:
        job.failed.write_text(f"gpu008 job=1.0 code=1 rank=0 {earlier_at}\n"
                              f"gpu009 job=2.0 code=1 rank=2 {earlier_at}\n")
    done = job.run(records("1700000000000100 gpu001 3 1", code=3),
                   REQUEUE_ON_FAILURE=requeues)
    assert done.returncode == 3
    assert job.failed_lines()[-1][:5] == ["gpu001", "job=12345.0", "code=3", "rank=1",
                                          "latest=10"]
    assert (job.calls()[-1:] == ["scontrol requeue 12345"]) == requeued, done.stdout
    if not requeued:
        assert "not requeueing; fix the cause and resubmit" in done.stdout


def test_sigterm_is_no_failure(job: Job) -> None:
    """scancel and preemption: the workers save and stop; no node is blamed, nothing requeued."""
    done = job.run(records("1700000000000100 gpu001 1 0", code=143).replace(
        "exit 143", "kill -TERM $PPID; sleep 0.3; exit 143"))
    assert done.returncode == 143 and "SIGTERM" in done.stdout, done.stdout + done.stderr
    assert not job.failed.exists() and not (job.run_dir / "checkpoints" / "node_exits").exists()
    assert [call for call in job.calls() if "hostnames" not in call] == []


def test_the_time_limit_requeue_also_excludes(job: Job) -> None:
    """SIGUSR1's save-and-requeue resubmits instead when a node failed twice since."""
    job.run_dir.mkdir()
    job.failed.write_text("gpu001\ngpu001\n")  # by hand: exclude gpu001
    done = job.run("kill -USR1 $PPID; sleep 0.3; exit 0")
    assert done.returncode == 0, done.stderr
    calls = [call for call in job.calls() if "hostnames" not in call]
    assert calls[0] == "scancel --signal=USR1 12345"
    assert any(c.startswith("sbatch") and "--exclude=gpu001" in c for c in calls), calls
    assert "checkpoint saved; excluding node(s) gpu001" in done.stdout
    assert job.failed.read_text() == "gpu001\ngpu001\n"


def test_bad_requeue_count_is_one_line(job: Job) -> None:
    done = job.run("exit 0", REQUEUE_ON_FAILURE="-1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("launch.sh: error: REQUEUE_ON_FAILURE is '-1': give a count "
                           "(0: never requeue a failure)\n")


def test_a_launcher_records_its_node_only_when_its_workers_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/launch.py's line, as failed_nodes.sh reads it: ``TIME_US NODE CODE RANK``."""
    monkeypatch.setenv(node_exit.NODE_EXIT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("SLURMD_NODENAME", "gpu042")
    node_exit.record(0, "")
    assert list(tmp_path.iterdir()) == []
    node_exit.record(137, 5)
    [path] = tmp_path.iterdir()
    stamp, *rest = path.read_text().split()
    assert rest == ["gpu042", "137", "5"] and path.name.startswith("gpu042.")
    assert abs(int(stamp) / 1e6 - time.time()) < 60
    monkeypatch.delenv(node_exit.NODE_EXIT_DIR_ENV)
    node_exit.record(1, 0)  # outside the SLURM scripts: nothing written anywhere
    assert len(list(tmp_path.iterdir())) == 1
