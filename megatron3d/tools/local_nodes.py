"""Run a launch as N nodes x K ranks on one machine, over rate-limited links.

    scripts/local_nodes.sh --nodes N --ranks-per-node K [--link-rate 2gbit] [--master-port P]
        [--slurm] -- pretrain_gpt.py ARGS...

Each node is a network namespace with its own address and host name (node0, node1, ...),
joined to the others through a bridge; each node's link is limited to --link-rate in both
directions (tc tbf) while its loopback, which carries the traffic between its own ranks,
stays unlimited. Every node runs torchrun (tools/launch.py) with --nnodes N --nproc-per-node
K and a c10d rendezvous at node0:P, as on a cluster; gloo binds the node's address
(GLOO_SOCKET_IFNAME=eth0). What follows ``--`` is torchrun's script and its arguments (or
``-m MODULE ARGS``).

--slurm runs the job through scripts/slurm/launch.sh instead, as an sbatch script would:
the batch shell on node0 with the SLURM_* variables of an N-node allocation, and an srun
that starts one task per node (SLURM_NODEID, SLURMD_NODENAME). The arguments must then be
pretrain_gpt.py's, with --save and --save-interval (launch.sh adds --save/--load DIR).

The exit code is the job's: 0 when every node's launcher exited 0, else the first non-zero
code (2 bad input, 3 a hang, 143 stopped by SIGTERM). After a node fails the others get
30 s to finish, then SIGTERM. SIGTERM or SIGINT to this process is forwarded to every
node's torchrun, which forwards it to its ranks (they save after their next step and exit).
Namespaces, links and host files are removed on the way out, and those of an interrupted
run first. Needs root and the ip, tc and unshare tools.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from megatron3d.cli.common import OneLineParser, add_int, run_tool
from megatron3d.config.ranges import AT_LEAST_ONE, Range
from megatron3d.errors import ConfigError
from megatron3d.log import get_logger, setup_logging
from megatron3d.tools.node_plan import (
    INTERFACE,
    MAX_NODES,
    NETNS_ETC,
    NodePlan,
    on_node,
    setup_commands,
    srun_script,
    stale_namespaces,
    teardown_commands,
    torchrun_options,
)

logger = get_logger("local_nodes")
REPO = Path(__file__).resolve().parents[2]
GRACE_S = 30.0  # after a node fails, how long the others may finish before SIGTERM
KILL_AFTER_S = 60.0  # and before SIGKILL
TOOLS = ("ip", "tc", "unshare")


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _parser() -> OneLineParser:
    p = OneLineParser(prog="local_nodes.sh", description=__doc__.splitlines()[0],
                      epilog="\n".join(__doc__.splitlines()[2:]),
                      formatter_class=_RawHelp)
    add_int(p, "--nodes", Range(1, MAX_NODES), "Nodes to emulate.", required=True)
    add_int(p, "--ranks-per-node", AT_LEAST_ONE, "Ranks (torchrun workers) per node.",
            required=True)
    p.add_argument("--link-rate", default="2gbit", metavar="RATE",
                   help="Each node's link rate, each direction, in tc's units (2gbit, "
                        "500mbit); 'none': unlimited. Default 2gbit.")
    add_int(p, "--master-port", Range(1, 65535), "Rendezvous port on node0.", default=29500)
    p.add_argument("--slurm", action="store_true",
                   help="Launch through scripts/slurm/launch.sh (see above).")
    return p


class _RawHelp(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's paragraphs as written."""


def _run(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    ours, command = _split(args)
    opts = _parser().parse(ours)
    if not command:
        raise ConfigError("no command after '--': give the script and its arguments, e.g. "
                          "-- pretrain_gpt.py --num-layers 2 ...")
    rate = None if opts.link_rate.lower() == "none" else opts.link_rate
    plan = NodePlan(os.getpid(), opts.nodes, opts.ranks_per_node, rate, opts.master_port)
    batch = _slurm_batch(plan, command) if opts.slurm else None
    _check_machine()
    setup_logging(0, log_rank=0)
    with _network(plan):
        job = _Job(plan, command, batch)
        return job.run()


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in args:
        return args, []
    at = args.index("--")
    return args[:at], args[at + 1:]


def _check_machine() -> None:
    if os.geteuid() != 0:
        raise ConfigError("local_nodes needs root (it creates network namespaces and tc "
                          "limits): run it as root, or with sudo")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"local_nodes needs {', '.join(missing)}: install iproute2 and "
                          "util-linux (apt-get install iproute2 util-linux)")


# --- the network -------------------------------------------------------------------------------

@contextmanager
def _network(plan: NodePlan) -> Iterator[None]:
    """Build the plan's namespaces (after removing those of runs that are gone); remove them
    on the way out, whatever happens."""
    _remove_stale()
    try:
        for ns in plan.namespaces():
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(plan.hosts_file())
        for command in setup_commands(plan):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise ConfigError(f"could not build the nodes' network: {' '.join(command)}: "
                                  f"{done.stderr.strip()}")
        logger.info("local_nodes: %d node(s) x %d rank(s), links %s each way; rendezvous %s",
                    plan.nodes, plan.ranks_per_node, plan.rate or "unlimited", plan.endpoint)
        yield
    finally:
        _remove(plan.namespaces(), [cmd for cmd in teardown_commands(plan)])


def _remove_stale() -> None:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             check=False).stdout
    alive = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    stale = stale_namespaces(listing, alive)
    if NETNS_ETC.is_dir():
        stale += stale_namespaces("\n".join(p.name for p in NETNS_ETC.iterdir()), alive)
    if stale:
        logger.info("local_nodes: removing %d namespace(s) left by runs that are gone",
                    len(set(stale)))
        _remove(sorted(set(stale)), [["ip", "netns", "delete", ns] for ns in set(stale)])


def _remove(namespaces: list[str], commands: list[list[str]]) -> None:
    for command in commands:
        subprocess.run(command, capture_output=True, check=False)
    for ns in namespaces:
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


# --- the job -----------------------------------------------------------------------------------

def _environment(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "GLOO_SOCKET_IFNAME": INTERFACE, "NCCL_SOCKET_IFNAME": INTERFACE, **extra}


def _flag(command: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``command`` (``FLAG V`` or ``FLAG=V``)."""
    value = None
    for i, word in enumerate(command):
        if word == flag and i + 1 < len(command):
            value = command[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def _slurm_batch(plan: NodePlan, command: list[str]) -> list[str]:
    """The batch shell's command: TRAIN_ARGS and the sbatch script's variables, then launch.sh."""
    if not command[0].endswith("pretrain_gpt.py"):
        raise ConfigError(f"--slurm runs pretrain_gpt.py through scripts/slurm/launch.sh, not "
                          f"{command[0]!r}: give -- pretrain_gpt.py ARGS")
    save, interval = _flag(command, "--save"), _flag(command, "--save-interval")
    if save is None or interval is None:
        raise ConfigError("--slurm needs --save DIR and --save-interval N among the arguments "
                          "(launch.sh saves and resumes there)")
    driver = ('GPUS_PER_NODE=$1 SAVE_INTERVAL=$2; shift 2; TRAIN_ARGS=("$@"); '
              'source "$MEGATRON3D_DIR/scripts/slurm/launch.sh"')
    return ["bash", "-c", driver, "local-nodes-batch", str(plan.ranks_per_node), interval,
            *command[1:]]


class _Job:
    """The nodes' launchers: started, watched, signalled, waited for."""

    def __init__(self, plan: NodePlan, command: list[str], batch: list[str] | None) -> None:
        self.plan, self.command, self.batch = plan, command, batch
        self.procs: list[subprocess.Popen] = []
        self.pid_dir = Path(tempfile.mkdtemp(prefix="megatron3d-nodes-"))
        self.signalled = 0
        self.stopping = False  # the nodes left after a failure were sent SIGTERM

    def run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._start()
            return self._wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._kill()
            shutil.rmtree(self.pid_dir, ignore_errors=True)

    def _start(self) -> None:
        if self.batch is None:
            for i in range(self.plan.nodes):
                options = torchrun_options(self.plan, i, f"local-nodes-{self.plan.owner}")
                cmd = [*on_node(self.plan, i), sys.executable, "-m", "megatron3d.tools.launch",
                       *options, *self.command]
                self._popen(cmd, _environment({}))
                logger.info("local_nodes: node %d (%s, %s, namespace %s): torchrun pid %d", i,
                            self.plan.hostname(i), self.plan.address(i), self.plan.namespace(i),
                            self.procs[-1].pid)
            return
        self._popen([*on_node(self.plan, 0), *self.batch], _environment(self._slurm_env()))
        logger.info("local_nodes: batch shell (scripts/slurm/launch.sh) on node0, pid %d",
                    self.procs[0].pid)

    def _popen(self, cmd: list[str], env: dict[str, str]) -> None:
        # A session of its own: only what this process forwards reaches the nodes.
        self.procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))

    def _slurm_env(self) -> dict[str, str]:
        bin_dir = self.pid_dir / "bin"
        bin_dir.mkdir()
        srun = bin_dir / "srun"
        srun.write_text(srun_script(self.plan, self.pid_dir))
        srun.chmod(0o755)
        save = Path(_flag(self.command, "--save") or ".").resolve()
        path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                os.environ.get("PATH", "")])
        env = {"PATH": path, "VENV": sys.prefix, "MEGATRON3D_DIR": str(REPO),
               "SLURM_JOB_ID": str(self.plan.owner), "SLURM_JOB_NAME": "local_nodes",
               "SLURM_JOB_NODELIST": self.plan.nodelist, "SLURM_NNODES": str(self.plan.nodes),
               "SLURM_SUBMIT_DIR": os.getcwd(), "MASTER_PORT": str(self.plan.port),
               "CHECKPOINT_DIR": str(save)}
        defaults = {"RUN_DIR": str(save.parent), "REQUEUE_ON_FAILURE": "0",
                    "TENSORBOARD_DIR": _flag(self.command, "--tensorboard-dir") or "",
                    "DATA_CACHE_DIR": _flag(self.command, "--data-cache-path")
                    or str(save.parent / "index-cache")}
        return {**{k: v for k, v in defaults.items() if k not in os.environ}, **env}

    def _launchers(self) -> list[int]:
        """Every node's torchrun: the processes started here, or srun's tasks (--slurm)."""
        if self.batch is None:
            return [p.pid for p in self.procs if p.poll() is None]
        pids = []
        for path in self.pid_dir.glob("node*.pid"):
            text = path.read_text().strip()
            if text.isdigit():
                pids.append(int(text))
        return pids

    def _forward(self, signum: int, _frame: object) -> None:
        self.signalled = signum
        logger.info("local_nodes: %s: forwarded to every node's torchrun",
                    signal.Signals(signum).name)
        for pid in self._launchers() + [p.pid for p in self.procs if p.poll() is None]:
            _signal(pid, signum)

    def _wait(self) -> int:
        first_failure: int | None = None
        failed_at = 0.0
        while any(p.poll() is None for p in self.procs):
            for p in self.procs:
                if p.returncode not in (None, 0) and first_failure is None:
                    first_failure, failed_at = p.returncode, time.monotonic()
                    logger.info("local_nodes: a node's launcher exited with code %d; the "
                                "others have %.0f s to finish", p.returncode, GRACE_S)
            if first_failure is not None:
                self._escalate(time.monotonic() - failed_at)
            time.sleep(0.2)
        if first_failure is None:
            first_failure = next((p.returncode for p in self.procs if p.returncode), 0)
        logger.info("local_nodes: the job exited with code %d", first_failure)
        return first_failure

    def _escalate(self, since_failure: float) -> None:
        if since_failure > KILL_AFTER_S:
            self._kill()
        elif since_failure > GRACE_S and not self.stopping:
            self.stopping = True
            for pid in self._launchers():
                _signal(pid, signal.SIGTERM)

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                _kill_tree(p.pid)
                p.wait()


def _signal(pid: int, signum: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signum)


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher's session (the launcher, its ranks, srun's tasks)."""
    with suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
