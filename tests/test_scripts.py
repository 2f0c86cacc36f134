"""The shell scripts: syntax, shellcheck and the SLURM launch command they render
(``test_fresh_clone.py`` runs the quickstart and a cpu_tiny job in a fresh clone).

The SLURM scripts are rendered for a fake allocation with ``LAUNCH_DRY_RUN=1`` (launch.sh
prints the layout, the outputs and its srun command line instead of running it) on a machine
without a Slurm configuration: ``scontrol`` on PATH fails, or there is none, and launch.sh
expands the host list itself. Every example's pretrain_gpt.py flags are then parsed and
validated for its world size, as pretrain_gpt.py would at start.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron3d.cli.arguments import parse_args
from megatron3d.validation import validate

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "scripts" / "slurm"
SLURM_SCRIPTS = sorted(SLURM_DIR.glob("*.slurm"))
APT_TIMEOUT_S = 300


def _is_shell_script(path: Path) -> bool:
    if path.suffix in (".sh", ".slurm"):
        return True
    first = path.read_bytes()[:64].split(b"\n", 1)[0]
    return first.startswith(b"#!") and first.rstrip().endswith((b"sh", b"bash"))


SCRIPTS = sorted(p for p in (REPO / "scripts").rglob("*") if p.is_file() and _is_shell_script(p))
SCRIPTS.append(REPO / ".ci" / "run")
IDS = [str(p.relative_to(REPO)) for p in SCRIPTS]

@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_bash_syntax(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def shellcheck() -> str:
    """The shellcheck binary; Debian's package is installed when we are root with apt-get."""
    found = shutil.which("shellcheck")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "shellcheck"]
        for cmd in (install, ["apt-get", "update", "-q"], install):
            try:
                subprocess.run(cmd, env=env, capture_output=True, timeout=APT_TIMEOUT_S,
                               check=False)
            except subprocess.TimeoutExpired:
                break
            found = shutil.which("shellcheck")
            if found:
                break
    if found is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck) and could not "
                    "be installed here (needs root and apt-get)")
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_shellcheck(shellcheck: str, script: Path) -> None:
    # -x -P SCRIPTDIR: follow `source` lines, resolving paths from the script's folder.
    done = subprocess.run([shellcheck, "-x", "-P", "SCRIPTDIR", "-f", "gcc", str(script)],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


# --- the rendered launch command ------------------------------------------------------------
FAILING_SCONTROL = """#!/bin/sh
echo "scontrol: fatal: Could not establish a configuration source" >&2
exit 1
"""
# A working scontrol, told apart from launch.sh's own expansion by the names it prints.
WORKING_SCONTROL = r'''#!PYTHON
import re
import sys

assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
for prefix, ranges in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?", sys.argv[3]):
    for part in ranges.split(",") if ranges else [""]:
        low, _, high = part.partition("-")
        for i in range(int(low or 0), int(high or low or 0) + 1):
            print(f"scontrol-{prefix}{i:0{len(low)}d}" if low else f"scontrol-{prefix}")
'''
# launch.sh's dry run runs pretrain_gpt.py --print-topology: here a stub that accepts any flags
# (test_dry_run_runs_the_start_up_checks gives it the real interpreter).
STUB_PYTHON = """#!/bin/sh
exit 0
"""
REAL_PYTHON = f"""#!/bin/sh
exec {shlex.quote(sys.executable)} "$@"
"""
KINDS = ("failing-scontrol", "no-scontrol", "working-scontrol")
BASH = shutil.which("bash") or "/bin/bash"
PORT = str(20000 + 12345 % 10000)  # launch.sh's default for job 12345


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture(scope="module")
def bins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A PATH folder per kind of machine; each holds nothing but its scontrol and a stub
    python, so a dry run that needed any other command would fail; "real-python" holds
    only the interpreter running these tests."""
    root = tmp_path_factory.mktemp("bin")
    folders = {kind: root / kind for kind in (*KINDS, "real-python")}
    for folder in folders.values():
        folder.mkdir()
        _executable(folder / "python", REAL_PYTHON if folder.name == "real-python"
                    else STUB_PYTHON)
    _executable(folders["failing-scontrol"] / "scontrol", FAILING_SCONTROL)
    _executable(folders["working-scontrol"] / "scontrol",
                WORKING_SCONTROL.replace("PYTHON", sys.executable, 1))
    return folders


def slurm_env(path: str, job_name: str, nodelist: str, nodes: int, **extra: str) -> dict[str, str]:
    """The environment of a fake allocation; extra adds or overrides variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("MASTER_PORT", "SCRATCH")}
    env.update({"PATH": path, "SLURM_JOB_ID": "12345", "SLURM_JOB_NAME": job_name,
                "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": nodelist,
                "SLURM_NNODES": str(nodes), **extra})
    return env


def dry_run(path: Path, script: Path, nodelist: str, nodes: int,
            **extra: str) -> subprocess.CompletedProcess:
    extra = {"VENV": "none", **extra}  # the python on PATH, not the checkout's .venv
    env = slurm_env(str(path), script.stem, nodelist, nodes, LAUNCH_DRY_RUN="1", **extra)
    return subprocess.run([BASH, str(script)], env=env, capture_output=True, text=True,
                          check=False)


def render(path: Path, script: Path, nodelist: str, nodes: int,
           **extra: str) -> tuple[list[str], list[str]]:
    """launch.sh's description lines (without "# ") and the srun command line it would run."""
    done = dry_run(path, script, nodelist, nodes, **extra)
    assert done.returncode == 0, done.stderr
    *described, command = done.stdout.splitlines()
    assert all(line.startswith("# ") for line in described), done.stdout
    return [line[2:] for line in described], shlex.split(command)


def hostlist(nodes: int) -> tuple[str, list[str]]:
    """A host list with a plain name, a range and a single number in brackets, expanded."""
    if nodes == 1:
        return "gpu001", ["gpu001"]
    if nodes == 2:
        return "gpu[001],cpu9", ["gpu001", "cpu9"]
    return (f"gpu[001,003-{nodes:03d}],cpu9",
            ["gpu001", *(f"gpu{i:03d}" for i in range(3, nodes + 1)), "cpu9"])


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def sbatch_nodes(script: Path) -> int:
    return int(re.search(r"^#SBATCH --nodes=(\d+)$", script.read_text(), re.MULTILINE)[1])


def training_flags(argv: list[str]) -> list[str]:
    return argv[argv.index(str(REPO / "pretrain_gpt.py")) + 1:]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=[p.name for p in SLURM_SCRIPTS])
def test_dry_run_without_slurm_configuration(bins: dict[str, Path], tmp_path: Path,
                                             script: Path, kind: str) -> None:
    """Nodes, rendezvous, TP x PP x DP and outputs outside the repository, with scontrol
    failing (no configuration), absent, or working (then its expansion is the one used)."""
    nodes = sbatch_nodes(script)
    nodelist, names = hostlist(nodes)
    if kind == "working-scontrol":
        names = [f"scontrol-{name}" for name in names]
    scratch = tmp_path / "scratch"
    (layout, hosts, outputs, failures), argv = render(bins[kind], script, nodelist, nodes,
                                                      SCRATCH=str(scratch), HOME=str(tmp_path))
    flags = training_flags(argv)
    gpus = int(value(argv, "--nproc-per-node"))
    tp = int(value(flags, "--tensor-model-parallel-size"))
    pp = int(value(flags, "--pipeline-model-parallel-size"))
    world = nodes * gpus
    assert layout.endswith(f"{nodes} node(s) x {gpus} workers = world {world} = "
                           f"TP {tp} x PP {pp} x DP {world // (tp * pp)}")
    assert hosts == f"nodes {' '.join(names)}; rendezvous {names[0]}:{PORT}"
    assert argv[:2] == ["srun", f"--nodes={nodes}"] and value(argv, "--nnodes") == str(nodes)
    assert value(argv, "--rdzv-endpoint") == f"{names[0]}:{PORT}"
    run_dir = scratch / "megatron3d" / script.stem
    assert value(flags, "--save") == value(flags, "--load") == str(run_dir / "checkpoints")
    written = [value(flags, "--save")]
    if "--data-path" in flags:  # cpu_tiny uses --mock-data and no TensorBoard
        assert value(flags, "--data-cache-path") == str(scratch / "megatron3d" / "index-cache")
        assert value(flags, "--tensorboard-dir") == str(run_dir / "tensorboard")
        written += [value(flags, "--data-cache-path"), value(flags, "--tensorboard-dir")]
        assert not Path(value(flags, "--data-path")).is_relative_to(REPO)
    assert all(path in outputs for path in written), outputs
    assert failures.startswith("on failure: up to 3 in-job restart(s)") and failures.endswith(
        f"failed nodes in {run_dir / 'failed_nodes.txt'}"), failures
    assert not any(Path(path).is_relative_to(REPO) for path in written), written


def test_four_node_command(bins: dict[str, Path], tmp_path: Path) -> None:
    script = SLURM_DIR / "pretrain_gpt.slurm"
    path = bins["failing-scontrol"]
    _, argv = render(path, script, "gpu[001-004]", 4, HOME=str(tmp_path), SLURM_NODEID="2")
    # One srun task per node; each runs torchrun through tools/launch.py (the job exits with
    # the failing rank's code) with SIGUSR1 ignored (see launch.sh).
    torchrun = argv.index("python3")
    srun, wrapper, cmd = argv[:4], argv[4:torchrun], argv[torchrun:]
    assert cmd[1] == str(REPO / "tools" / "launch.py")
    assert srun == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert wrapper[:2] == ["bash", "-c"] and 'trap "" USR1' in wrapper[2]
    assert value(cmd, "--nproc-per-node") == "8"
    assert value(cmd, "--rdzv-backend") == "c10d"
    assert value(cmd, "--rdzv-id") == "12345"
    # A failed worker restarts every worker of the job in place (c10d across the nodes).
    assert value(cmd, "--max-restarts") == "3" and float(value(cmd, "--monitor-interval")) <= 1
    flags = training_flags(cmd)
    assert value(flags, "--zero-stage") == "1"
    # Without $SCRATCH, outputs go to ~/scratch; each directory can be moved on its own.
    assert value(flags, "--save") == f"{tmp_path}/scratch/megatron3d/pretrain_gpt/checkpoints"
    assert value(flags, "--save-interval") == "1000"
    # The same command on every node: c10d rendezvous numbers the nodes, not SLURM_NODEID.
    assert render(path, script, "gpu[001-004]", 4, HOME=str(tmp_path), SLURM_NODEID="0")[1] == argv
    _, moved = render(path, script, "gpu[001-004]", 4, HOME=str(tmp_path), MASTER_PORT="29500",
                      OUTPUT_ROOT="/o", RUN_DIR="/r", TENSORBOARD_DIR="/tb", MAX_RESTARTS="0")
    assert value(moved, "--rdzv-endpoint") == "gpu001:29500"
    assert value(moved, "--max-restarts") == "0"
    assert [value(moved, f) for f in ("--save", "--tensorboard-dir", "--data-cache-path")] \
        == ["/r/checkpoints", "/tb", "/o/index-cache"]


# Slurm's host list forms; where scontrol can run with a minimal configuration it must agree.
HOSTLISTS = {
    "node[01-04,07],other[1-2]": "node01 node02 node03 node04 node07 other1 other2",
    "rack[1-2]-n[01-02]": "rack1-n01 rack1-n02 rack2-n01 rack2-n02",
    "a1,b[8-10]": "a1 b8 b9 b10",
    "c[098-101]": "c098 c099 c100 c101",
}


@pytest.mark.parametrize("nodelist", HOSTLISTS)
def test_hostlist_expansion(bins: dict[str, Path], tmp_path: Path, nodelist: str) -> None:
    expected = HOSTLISTS[nodelist].split()
    scontrol = shutil.which("scontrol")
    if scontrol:
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=c\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                        "PartitionName=p Nodes=localhost\n")
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                              text=True, check=False, env={**os.environ, "SLURM_CONF": str(conf)})
        if done.returncode == 0:
            assert done.stdout.split() == expected
    lines, _ = render(bins["no-scontrol"], SLURM_DIR / "cpu_tiny.slurm", nodelist,
                      len(expected), HOME=str(tmp_path))
    assert lines[1].startswith(f"nodes {' '.join(expected)}; rendezvous {expected[0]}:")


@pytest.mark.parametrize(("nodelist", "nodes", "hook", "message"), [
    ("gpu[001-", 1, "", "SLURM_JOB_NODELIST is 'gpu[001-': not a host list like"),
    ("gpu[1-2]", 3, "", "SLURM_JOB_NODELIST expands to 2 hosts, SLURM_NNODES is 3"),
    ("gpu1", 1, "GPUS_PER_NODE=3", "world size 3 (1 node(s) x 3) is not divisible by TP 1 x PP 2"),
    ("gpu1", 1, "TRAIN_ARGS+=(--tensor-model-parallel-size=0)",
     "--tensor-model-parallel-size is '0': give a positive integer"),
    ("gpu1", 1, "MAX_RESTARTS=two", "MAX_RESTARTS is 'two': give torchrun's restart count"),
])
def test_bad_allocation_is_one_line(bins: dict[str, Path], tmp_path: Path, nodelist: str,
                                    nodes: int, hook: str, message: str) -> None:
    (tmp_path / "hook.sh").write_text(hook)
    done = dry_run(bins["no-scontrol"], SLURM_DIR / "cpu_tiny.slurm", nodelist, nodes,
                   HOME=str(tmp_path), SETUP_HOOK=str(tmp_path / "hook.sh"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_dry_run_runs_the_start_up_checks(bins: dict[str, Path], tmp_path: Path) -> None:
    """LAUNCH_DRY_RUN exits 2 with pretrain_gpt.py's one line where the launch would fail
    after the queue wait (here the data is not there yet; every check --print-topology makes
    is in test_pretrain_cli.py), writing nothing; 0 where it would start."""
    done = dry_run(bins["real-python"], SLURM_DIR / "gpt2_1.3b_1node.slurm", "g1", 1,
                   HOME=str(tmp_path))
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert f"no dataset at data prefix '{tmp_path}/scratch/megatron3d/data/" in done.stderr
    assert not (tmp_path / "scratch").exists()
    lines, argv = render(bins["real-python"], SLURM_DIR / "cpu_tiny.slurm", "g1", 1,
                         HOME=str(tmp_path))
    assert lines[0].endswith("= TP 1 x PP 2 x DP 1") and argv[0] == "srun"


def test_setup_hook_runs_before_the_launch(bins: dict[str, Path], tmp_path: Path) -> None:
    """The site hook (module load, a container) is sourced first and can add srun options."""
    hook = tmp_path / "site.sh"
    hook.write_text(': "$NEVER_SET"  # module and conda scripts read unset variables\n'
                    'SRUN_ARGS=(--container-image=nvcr.io#nvidia/pytorch:24.09-py3)\n')
    _, argv = render(bins["failing-scontrol"], SLURM_DIR / "gpt2_1.3b_1node.slurm", "g1", 1,
                     HOME=str(tmp_path), SETUP_HOOK=str(hook))
    assert argv[4:6] == ["--container-image=nvcr.io#nvidia/pytorch:24.09-py3", "bash"]
    done = dry_run(bins["no-scontrol"], SLURM_DIR / "cpu_tiny.slurm", "g1", 1,
                   HOME=str(tmp_path), SETUP_HOOK=str(tmp_path / "missing.sh"))
    assert done.returncode == 2 and "SETUP_HOOK=" in done.stderr and "missing.sh" in done.stderr


@pytest.mark.parametrize(("hook", "hang_dir"), [
    ("", "{checkpoints}/hang"),
    ("TRAIN_ARGS+=(--hang-dump-dir=/elsewhere/hang)", "/elsewhere/hang"),
], ids=["default", "--hang-dump-dir"])
def test_torch_flight_recorder_writes_beside_the_hang_dumps(bins: dict[str, Path],
                                                             tmp_path: Path, hook: str,
                                                             hang_dir: str) -> None:
    """Every worker gets torch's NCCL flight recorder on, dumping into the hang dump folder
    (the variables are read as the workers inherit them: at the dry run's exit)."""
    exported = ("trap 'for v in ${!TORCH_NCCL_*}; do [[ $(declare -p $v) == \"declare -x\"* ]] "
                "&& echo \"$v=${!v}\" >&2; done' EXIT")
    (tmp_path / "hook.sh").write_text(f"{hook}\n{exported}\n")
    done = dry_run(bins["no-scontrol"], SLURM_DIR / "pretrain_gpt.slurm", "g1", 1,
                   HOME=str(tmp_path), SETUP_HOOK=str(tmp_path / "hook.sh"))
    assert done.returncode == 0, done.stderr
    checkpoints = tmp_path / "scratch" / "megatron3d" / "pretrain_gpt" / "checkpoints"
    env = dict(line.split("=", 1) for line in done.stderr.splitlines())
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE":
                   hang_dir.format(checkpoints=checkpoints) + "/nccl_trace_rank_"}, done.stderr


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=[p.name for p in SLURM_SCRIPTS])
def test_flags_are_valid_for_the_allocation(bins: dict[str, Path], tmp_path: Path,
                                            script: Path) -> None:
    """Every flag exists and the layout, batch sizes and ramp fit nodes x GPUs per node."""
    nodes = sbatch_nodes(script)
    _, argv = render(bins["failing-scontrol"], script, hostlist(nodes)[0], nodes,
                     HOME=str(tmp_path))
    world = nodes * int(value(argv, "--nproc-per-node"))
    validate(parse_args(training_flags(argv)), world)


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=[p.name for p in SLURM_SCRIPTS])
def test_sbatch_header(script: Path) -> None:
    """What launch.sh relies on: one task per node, the warning signal to the batch shell, a
    requeueable job, and one appended log per job; and the site placeholders users fill in."""
    text = script.read_text()
    header = set(re.findall(r"^#SBATCH (\S+)", text, re.MULTILINE))
    assert {"--ntasks-per-node=1", "--requeue", "--output=logs/%x-%j.out",
            "--open-mode=append"} <= header
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", h) for h in header)
    assert {"##SBATCH --partition=PARTITION", "##SBATCH --account=ACCOUNT"} <= set(
        text.splitlines())
    assert "SETUP_HOOK" in text.split("\n#SBATCH")[0]  # documented in the header
    assert text.rstrip().endswith('source "$MEGATRON3D_DIR/scripts/slurm/launch.sh"')


def test_launch_outside_slurm_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(SLURM_DIR / "cpu_tiny.slurm")], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "not inside a Slurm job" in done.stderr
