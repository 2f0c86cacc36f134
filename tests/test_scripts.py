"""The shell scripts: syntax, shellcheck, and the SLURM launch command they render.

The SLURM scripts are rendered for a fake allocation with ``LAUNCH_DRY_RUN=1`` (launch.sh
prints its srun command line instead of running it) and a stub ``scontrol`` that expands
host lists, so these tests need neither Slurm nor GPUs. Every example's pretrain_gpt.py flags
are then parsed and validated for its world size, as pretrain_gpt.py would at start.
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

from megatron3d.arguments import parse_args
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
STUB_SCONTROL = r'''#!PYTHON
"""scontrol show hostnames LIST: prefix[001-004,007],other -> one host per line."""
import re
import sys

assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,]+)", sys.argv[3]):
    if plain:
        print(plain)
        continue
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        for i in range(int(low), int(high or low) + 1):
            print(f"{prefix}{i:0{len(low)}d}")
'''


@pytest.fixture(scope="module")
def stub_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stub-bin")
    scontrol = folder / "scontrol"
    scontrol.write_text(STUB_SCONTROL.replace("PYTHON", sys.executable, 1))
    scontrol.chmod(0o755)
    return folder


def render(stub_bin: Path, script: Path, nodes: int, node_id: int = 0,
           **extra: str) -> list[str]:
    """The srun command line launch.sh would run for a fake allocation gpu[001-nodes]."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.pop("MASTER_PORT", None)
    env.update(PATH=f"{stub_bin}:{env.get('PATH', '')}", LAUNCH_DRY_RUN="1",
               SLURM_JOB_ID="12345", SLURM_JOB_NAME=script.stem, SLURM_SUBMIT_DIR=str(REPO),
               SLURM_JOB_NODELIST=f"gpu[001-{nodes:03d}]", SLURM_NNODES=str(nodes),
               SLURM_NODEID=str(node_id), **extra)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout)


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def sbatch_nodes(script: Path) -> int:
    return int(re.search(r"^#SBATCH --nodes=(\d+)$", script.read_text(), re.MULTILINE)[1])


def test_four_node_command(stub_bin: Path) -> None:
    script = SLURM_DIR / "pretrain_gpt.slurm"
    argv = render(stub_bin, script, nodes=4, node_id=2)
    # One srun task per node; each runs torchrun with SIGUSR1 ignored (see launch.sh).
    torchrun = argv.index("torchrun")
    srun, wrapper, cmd = argv[:4], argv[4:torchrun], argv[torchrun:]
    assert srun == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert wrapper[:2] == ["bash", "-c"] and 'trap "" USR1' in wrapper[2]
    assert value(cmd, "--nnodes") == "4"
    assert value(cmd, "--nproc-per-node") == "8"
    assert value(cmd, "--rdzv-backend") == "c10d"
    assert value(cmd, "--rdzv-endpoint") == f"gpu001:{20000 + 12345 % 10000}"
    assert value(cmd, "--rdzv-id") == "12345"
    entry = cmd.index(str(REPO / "pretrain_gpt.py"))
    flags = cmd[entry + 1:]
    assert value(flags, "--tensor-model-parallel-size") == "2"
    assert value(flags, "--pipeline-model-parallel-size") == "2"
    assert value(flags, "--zero-stage") == "1"
    assert value(flags, "--save") == value(flags, "--load") == "checkpoints/pretrain_gpt"
    assert value(flags, "--save-interval") == "1000"
    # The same command on every node: c10d rendezvous numbers the nodes, not SLURM_NODEID.
    assert render(stub_bin, script, nodes=4, node_id=0) == argv
    assert value(render(stub_bin, script, nodes=4, MASTER_PORT="29500"),
                 "--rdzv-endpoint") == "gpu001:29500"


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=[p.name for p in SLURM_SCRIPTS])
def test_flags_are_valid_for_the_allocation(stub_bin: Path, script: Path) -> None:
    """Every flag exists and the layout, batch sizes and ramp fit nodes x GPUs per node."""
    nodes = sbatch_nodes(script)
    argv = render(stub_bin, script, nodes)
    world = nodes * int(value(argv, "--nproc-per-node"))
    flags = argv[argv.index(str(REPO / "pretrain_gpt.py")) + 1:]
    validate(parse_args(flags), world)


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=[p.name for p in SLURM_SCRIPTS])
def test_sbatch_header(script: Path) -> None:
    """What launch.sh relies on: one task per node, the warning signal to the batch shell, a
    requeueable job, and one appended log per job."""
    header = set(re.findall(r"^#SBATCH (\S+)", script.read_text(), re.MULTILINE))
    assert {"--ntasks-per-node=1", "--requeue", "--output=logs/%x-%j.out",
            "--open-mode=append"} <= header
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", h) for h in header)
    assert script.read_text().rstrip().endswith('source "$MEGATRON3D_DIR/scripts/slurm/launch.sh"')


def test_launch_outside_slurm_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(SLURM_DIR / "cpu_tiny.slurm")], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "not inside a Slurm job" in done.stderr
