"""``tools/launch.py``, torchrun for job scripts: the job ends with the first failing rank's
exit code (torchrun alone exits 1 whatever the ranks returned) and its ``error:`` line
printed once, without torchrun's report or tracebacks.

One real torchrun launch of two ranks: they resume from a checkpoint saved by two ranks
whose second rank file is truncated. Rank 1 fails to read its own file while rank 0 reads
its file fine; both must stop with rank 1's line (rank 0 used to crash with a traceback inside
the load's error exchange and write hang dumps into the checkpoint directory).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pretrain_gpt
from megatron3d.resilience.node_exit import NODE_EXIT_DIR_ENV
from megatron3d.tools import reshape
from tests.checkpoint.test_bad_checkpoints import _tree
from tests.helpers.tiny import train_argv

ROOT = Path(__file__).resolve().parents[1]


def _two_rank_checkpoint(tmp_path: Path) -> Path:
    one = tmp_path / "one"
    assert pretrain_gpt.main(train_argv("gpt2", 5, "--save", str(one), "--exit-interval",
                                        "3")) == 0
    two = tmp_path / "two"
    assert reshape.main(["--load", str(one), "--save", str(two), "--tensor-model-parallel-size",
                         "1", "--pipeline-model-parallel-size", "1",
                         "--data-parallel-size", "2"]) == 0
    return two


def test_the_job_exits_with_the_ranks_code_and_one_line(tmp_path):
    root = _two_rank_checkpoint(tmp_path)
    damaged = root / "iter_0000003" / "rank_00001.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])
    before = _tree(root)
    exits = tmp_path / "node_exits"  # what the SLURM scripts read to name a failed node
    exits.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           NODE_EXIT_DIR_ENV: str(exits), "SLURMD_NODENAME": "node7"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"),
                           "--nproc-per-node", "2", str(ROOT / "pretrain_gpt.py"),
                           *train_argv("gpt2", 5, "--load", str(root), "--save", str(root))],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    errors = [ln for ln in output.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "rank_00001.pt cannot be read" in errors[0], output[-3000:]
    assert done.stderr == errors[0] + "\n", done.stderr[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
    assert _tree(root) == before and not (root / "hang").exists()
    [record] = [path.read_text().split() for path in exits.iterdir()]
    # every rank stops with the agreed line, so either may have written it first
    assert record[1:3] == ["node7", "2"] and record[3] in {"0", "1"}, record
    assert record[0].isdigit(), record
