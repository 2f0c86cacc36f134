"""A real single-node Slurm on this machine runs scripts/slurm/cpu_tiny.slurm through sbatch.

What a cluster user relies on, end to end: a job trains and checkpoints; a second job resumes
from the checkpoint; SIGUSR1 to the batch shell (the time-limit warning of
``--signal=B:USR1@N``) saves, requeues and resumes; SIGUSR1 to the job steps saves and stops;
scancel's SIGTERM saves. Every job goes through scripts/slurm/launch.sh exactly as on a cluster.

``LocalSlurm.start()`` installs Debian's Slurm and munge if they are missing (as root, with
apt-get), then starts its own munged, slurmctld and slurmd: free ports, a fresh munge key, all
state, spool, sockets and logs in one temporary directory, nothing under /etc touched. The
daemons are ours by PID and ``stop()`` cancels every job and stops them. Whatever cannot be
installed or started becomes a skip that says why.

Constraints of containers and CI machines, and what the configuration does about them:
- no cgroups: ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``;
- the hostname may not resolve: the node is ``localhost`` at 127.0.0.1 (``slurmd -N localhost``);
- fewer cores or less memory than declared: ``SlurmdParameters=config_overrides``;
- a requeued job waits ``cred_expire`` seconds (default 120) before it may start again: 5 here
  (a step's launch credential lives as long; its launch takes well under a second).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from megatron3d.checkpoint import io

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo"]
APT_TIMEOUT_S = 300
START_TIMEOUT_S = 30
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class Unavailable(Exception):  # noqa: N818 - reads as "Slurm is unavailable: why"
    """Slurm cannot be installed or started here; the message says why."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def ensure_installed() -> None:
    """Install Debian's packages when a binary is missing and we may (root, apt-get)."""
    missing = [b for b in BINARIES if _which(b) is None]
    if not missing:
        return
    if os.geteuid() != 0 or _which("apt-get") is None:
        raise Unavailable(f"{', '.join(missing)} not installed, and installing needs root and "
                          f"apt-get: apt-get install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    for cmd in (install, ["apt-get", "update", "-q"], install):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=APT_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"{' '.join(cmd)} took over {APT_TIMEOUT_S} s") from None
        if done.returncode == 0 and cmd is install:
            break
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        raise Unavailable(f"apt-get could not install {' '.join(PACKAGES)}: "
                          f"{(done.stdout + done.stderr)[-500:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} missing)"


class LocalSlurm:
    """One node (``localhost``, 2 CPUs) in one partition; clients get ``SLURM_CONF``."""

    def __init__(self) -> None:
        # munged wants every directory on its socket's path searchable by all, which pytest's
        # private temporary directories are not.
        self.root = Path(tempfile.mkdtemp(prefix="megatron3d-slurm-"))
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        ensure_installed()
        key = self.root / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(128))
        os.close(fd)
        sock = self.root / "munge.sock"
        self._daemon("munged", "-F", f"--socket={sock}", f"--key-file={key}",
                     f"--pid-file={self.root / 'munged.pid'}",
                     f"--log-file={self.root / 'munged.log'}",
                     f"--seed-file={self.root / 'munged.seed'}")
        self._wait(sock.exists, "munged to create its socket", self.root / "munged.out")
        for sub in ("state", "spool"):
            (self.root / sub).mkdir()
        self.conf.write_text(self._config(sock))
        self._daemon("slurmctld", "-D", "-f", str(self.conf))
        self._daemon("slurmd", "-D", "-N", "localhost", "-f", str(self.conf))
        self._wait(lambda: self.client("sinfo", "-h", "-N", "-o", "%T").stdout.strip() == "idle",
                   "the node to be idle in sinfo", self.root / "slurmctld.out")

    def stop(self) -> None:
        """Cancel every job (so no training process outlives the test), stop our daemons."""
        if self.conf.exists() and any(p.poll() is None for p in self.procs):
            jobs = self.client("squeue", "-h", "-o", "%i").stdout.split()
            if jobs:
                self.client("scancel", *jobs)
                deadline = time.monotonic() + 30
                while self.client("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def _daemon(self, name: str, *args: str) -> None:
        with open(self.root / f"{name}.out", "w") as out:  # the daemon keeps its own copy
            self.procs.append(subprocess.Popen([_which(name) or name, *args], stdout=out,
                                               stderr=subprocess.STDOUT, env=self.env))

    def _wait(self, ready: Callable[[], bool], what: str, log: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"no luck in {START_TIMEOUT_S} s"
                raise Unavailable(f"waiting for {what}: {why}; {log.name}: {_tail(log, 800)}")
            time.sleep(0.3)

    def _config(self, munge_socket: Path) -> str:
        r = self.root
        return "\n".join([
            "ClusterName=megatron3d",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # Our munged; cred_expire is also how long a requeued job waits to start again.
            f"AuthInfo=socket={munge_socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=600",  # finished jobs stay visible to `scontrol show job`
            "KillWait=10",
            "NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    # --- clients ------------------------------------------------------------------------------
    def client(self, *args: str, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([_which(args[0]) or args[0], *args[1:]], cwd=cwd,
                              env=env or self.env, capture_output=True, text=True, timeout=60,
                              check=False)

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, ...)."""
        out = self.client("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_until(self, ready: Callable[[], object], timeout: float, what: str,
                   context: Callable[[], str]) -> object:
        """Poll ``ready`` until it returns something truthy; fail with ``context()``."""
        deadline = time.monotonic() + timeout
        while True:
            value = ready()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n"
                                     f"{context()[-3000:]}")
            time.sleep(0.5)


# --- the tests ---------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "cpu_tiny.slurm"
JOB_TIMEOUT_S = 150  # a tiny job takes ~15 s; generous for a loaded 2-core machine
ITER_LINE = re.compile(r"^ iteration +(\d+)/ *\d+ \|.*\| lm loss: (\S+) \|", re.MULTILINE)
LOADED = re.compile(r"loaded (\S+) \(iteration (\d+)\)")
SAVED = re.compile(r"saved checkpoint at iteration (\d+)")
STOPPING = re.compile(r"stopping at iteration (\d+)")
RUN_START = re.compile(r"^launch\.sh: job \d+ \(restart \d+\)", re.MULTILINE)
NEVER = 1_000_000  # an iteration count no test reaches


@pytest.fixture(scope="module")
def slurm() -> Iterator[Cluster]:
    cluster = LocalSlurm()
    try:
        cluster.start()
    except Unavailable as err:
        cluster.stop()
        pytest.skip(f"no local Slurm: {err}")
    try:
        yield Cluster(cluster)
    finally:
        cluster.stop()


class Cluster:
    """Submits cpu_tiny.slurm and reads what its jobs did."""

    def __init__(self, slurm: LocalSlurm) -> None:
        self.slurm = slurm
        self.submit_dir = slurm.root / "submit"
        (self.submit_dir / "logs").mkdir(parents=True)  # sbatch does not create it

    def submit(self, checkpoint_dir: Path, train_iters: int, save_interval: int,
               *sbatch_args: str, **job_env: str) -> int:
        env = {k: v for k, v in self.slurm.env.items() if not k.startswith("SLURM_")}
        env.update(SLURM_CONF=str(self.slurm.conf), MEGATRON3D_DIR=str(REPO), VENV=sys.prefix,
                   PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
                   CHECKPOINT_DIR=str(checkpoint_dir), TRAIN_ITERS=str(train_iters),
                   SAVE_INTERVAL=str(save_interval), **job_env)
        done = self.slurm.client("sbatch", "--parsable", *sbatch_args, str(SCRIPT),
                                 cwd=self.submit_dir, env=env)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip().split(";")[0])

    def log(self, job_id: int) -> str:
        path = self.submit_dir / "logs" / f"cpu_tiny-{job_id}.out"  # --output=logs/%x-%j.out
        return path.read_text(errors="replace") if path.exists() else ""

    def runs(self, job_id: int) -> list[str]:
        """The log split into the runs of the job (a requeued job appends a second run)."""
        return RUN_START.split(self.log(job_id))[1:]

    def wait_for_log(self, job_id: int, ready: Callable[[list[str]], object]) -> object:
        return self.slurm.wait_until(lambda: ready(self.runs(job_id)), JOB_TIMEOUT_S,
                                     f"job {job_id}'s log", lambda: self.log(job_id))

    def wait_done(self, job_id: int) -> dict[str, str]:
        """The job's final fields, once all of its processes are gone (not even COMPLETING)."""
        def done() -> dict[str, str] | None:
            job = self.slurm.job(job_id)
            if job.get("JobState") not in FINAL_STATES:
                return None
            listed = self.slurm.client("squeue", "-h", "-j", str(job_id)).stdout.strip()
            return None if listed else job

        return self.slurm.wait_until(done, JOB_TIMEOUT_S, f"job {job_id} to end",
                                     lambda: self.log(job_id))

    def job(self, job_id: int) -> dict[str, str]:
        return self.slurm.job(job_id)

    def scancel(self, *args: str) -> None:
        done = self.slurm.client("scancel", *args)
        assert done.returncode == 0, done.stderr


def _iterations(run: str) -> list[tuple[int, float]]:
    return [(int(m[1]), float(m[2])) for m in ITER_LINE.finditer(run)]


def _assert_no_workers_left(checkpoint_dir: Path) -> None:
    """Every process of the job is gone: none has the test's checkpoint dir on its command line."""
    left = subprocess.run(["pgrep", "-af", str(checkpoint_dir)], capture_output=True, text=True,
                          check=False).stdout
    assert not left.strip(), f"processes outlived their job:\n{left}"


def test_train_then_resume(slurm: Cluster, tmp_path: Path) -> None:
    first = slurm.submit(tmp_path, train_iters=30, save_interval=10)
    job = slurm.wait_done(first)
    log = slurm.log(first)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    losses = [loss for _, loss in _iterations(log)]
    assert len(losses) == 6 and losses[-1] < losses[0], log[-3000:]
    assert not LOADED.search(log), "a fresh checkpoint dir must start from scratch"
    assert io.read_latest(tmp_path) == 30 and io.iteration_dir(tmp_path, 30).is_dir()

    second = slurm.submit(tmp_path, train_iters=60, save_interval=10)
    job = slurm.wait_done(second)
    log = slurm.log(second)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    loaded = LOADED.search(log)
    assert loaded and int(loaded[2]) == 30, log[-3000:]
    assert [it for it, _ in _iterations(log)] == list(range(35, 61, 5))
    assert _iterations(log)[0][1] < losses[0]  # it continued from trained weights
    assert io.read_latest(tmp_path) == 60
    _assert_no_workers_left(tmp_path)


def test_usr1_to_batch_saves_requeues_and_resumes(slurm: Cluster, tmp_path: Path) -> None:
    """The time-limit warning's path: SIGUSR1 to the batch shell (what --signal=B:USR1 does)."""
    job_id = slurm.submit(tmp_path, train_iters=NEVER, save_interval=NEVER)
    slurm.wait_for_log(job_id, lambda runs: runs and _iterations(runs[0]))
    slurm.scancel("--signal=USR1", "--batch", str(job_id))
    # The first run saves and requeues; the second resumes from that checkpoint and trains.
    slurm.wait_for_log(job_id, lambda runs: len(runs) == 2 and _iterations(runs[1]))
    first, second = slurm.runs(job_id)
    stopped = STOPPING.search(first)
    assert stopped and f"saved checkpoint at iteration {stopped[1]}" in first, first[-3000:]
    assert "requeueing job" in first and "training step exited with code 0" in first
    loaded = LOADED.search(second)
    assert loaded and loaded[2] == stopped[1], second[-3000:]
    assert slurm.job(job_id)["Restarts"] == "1"

    # SIGUSR1 to the job steps only: save and stop without a requeue.
    slurm.scancel("--signal=USR1", str(job_id))
    job = slurm.wait_done(job_id)
    second = slurm.runs(job_id)[1]
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1")
    again = STOPPING.search(second)
    assert again and int(again[1]) > int(stopped[1]), second[-3000:]
    assert io.read_latest(tmp_path) == int(again[1])
    assert "requeueing job" not in second
    _assert_no_workers_left(tmp_path)


def test_scancel_sigterm_saves(slurm: Cluster, tmp_path: Path) -> None:
    """Preemption and scancel send SIGTERM everywhere: torchrun forwards it, the ranks save."""
    job_id = slurm.submit(tmp_path, train_iters=NEVER, save_interval=NEVER)
    slurm.wait_for_log(job_id, lambda runs: runs and _iterations(runs[0]))
    slurm.scancel(str(job_id))
    job = slurm.wait_done(job_id)
    log = slurm.log(job_id)
    assert job["JobState"] == "CANCELLED", log[-3000:]
    stopped = STOPPING.search(log)
    assert stopped and SAVED.findall(log) == [stopped[1]], log[-3000:]
    assert io.read_latest(tmp_path) == int(stopped[1])
    _assert_no_workers_left(tmp_path)


def test_time_limit_warning_saves_requeues_and_resumes(slurm: Cluster, tmp_path: Path) -> None:
    """Slurm's own timer: a 1-minute job with --signal=B:USR1@45 is warned at most 15 s in
    (Slurm may send it up to 60 s early, possibly before the workers can take it: launch.sh
    repeats it), saves, is requeued and resumes."""
    job_id = slurm.submit(tmp_path, NEVER, NEVER, "--time=1", "--signal=B:USR1@45")
    slurm.wait_for_log(job_id, lambda runs: len(runs) == 2 and _iterations(runs[1]))
    slurm.scancel(str(job_id))  # the second run would be warned and requeued again
    slurm.wait_done(job_id)
    first, second = slurm.runs(job_id)[:2]
    stopped = STOPPING.search(first)
    assert stopped and "requeueing job" in first, first[-3000:]
    loaded = LOADED.search(second)
    assert loaded and loaded[2] == stopped[1], second[-3000:]
    _assert_no_workers_left(tmp_path)


def _kill_workers(checkpoint_dir: Path) -> list[int]:
    """SIGKILL every training process of the job (not its launcher), as a node losing its
    devices would; their PIDs. (One killed alone leaves its peers to torchrun's 30 s shutdown
    grace, waiting for it in a collective.)"""
    killed = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (proc.name.isdigit() and str(REPO / "pretrain_gpt.py") in argv[1:3]
                and str(checkpoint_dir) in argv):  # `python [-u] pretrain_gpt.py`
            os.kill(int(proc.name), signal.SIGKILL)
            killed.append(int(proc.name))
    assert killed, "no worker of the job to kill"
    return killed


def test_a_killed_worker_fails_the_step_and_its_node_is_recorded(slurm: Cluster,
                                                                 tmp_path: Path) -> None:
    """SIGKILLed workers once torchrun has no restarts left (MAX_RESTARTS=0 here): the
    node's launcher names it, launch.sh adds it to the failed-node list (here its second
    line: to be excluded) and the job requeues. This Slurm has one node, so sbatch refuses the
    resubmission excluding it and the job is requeued as it is (test_failed_nodes.py checks
    the resubmission's options)."""
    failed = tmp_path / "failed_nodes.txt"
    failed.write_text("localhost\n")  # failed once before (by hand: any line counts)
    ckpt = tmp_path / "ckpt"
    job_id = slurm.submit(ckpt, NEVER, 4, MAX_RESTARTS="0", REQUEUE_ON_FAILURE="1",
                          FAILED_NODES_FILE=str(failed))
    slurm.wait_for_log(job_id, lambda runs: runs and _iterations(runs[0]))
    killed = _kill_workers(ckpt)
    slurm.slurm.wait_until(lambda: "requeueing job" in slurm.log(job_id), JOB_TIMEOUT_S,
                           f"job {job_id} to requeue after killing {killed}",
                           lambda: "\n".join(ln for ln in slurm.log(job_id).splitlines()
                                             if "iteration " not in ln))
    slurm.scancel(str(job_id))  # requeued: cancelled before its next run starts
    slurm.wait_done(job_id)
    first = slurm.runs(job_id)[0]
    assert re.search(r"node localhost failed first \(exit 137, rank \d\)", first), first[-3000:]
    assert "failed twice, but submitting the job again with --exclude failed" in first
    assert "requeueing job" in first and slurm.job(job_id)["Restarts"] == "1"
    lines = failed.read_text().splitlines()
    assert len(lines) == 2 and lines[0] == "localhost", lines
    assert lines[1].startswith(f"localhost job={job_id}.0 code=137 rank="), lines
    assert not (ckpt / "node_exits").exists()
    _assert_no_workers_left(ckpt)
