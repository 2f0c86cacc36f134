"""Recovery from killed ranks under ``torchrun --max-restarts``: how long, how many steps run
twice, and whether the model comes out bitwise the same; and what the local checkpoints
that make it cheap cost.

For each shape of ``recovery_runs.SHAPES`` ((tp 2, pp 2, dp 2) with ZeRO-1, ZeRO-3, and
ZeRO-1 with an interleaved schedule), an uninterrupted run and a run in which one random
rank is SIGKILLed at a random step (seeded: ``--seed``); then, at ZeRO-1, a run in which a
rank and the peer that holds its replica are frozen, their stores deleted and both killed
(the state is gone everywhere: the run falls back to the last global checkpoint). Each row:
seconds from the kill until every rank finished a step of the restarted job, steps logged
again after the restart, and bitwise equality (every step's loss at full precision and the
final checkpoint's rank files, tensor by tensor). Last, the cost of a local save at every
step on ``benchmarks/local_save.py``'s shape: the ratio of the median step with saves to
without, in one run.

    python -m benchmarks.recovery
    python -m benchmarks.recovery --seed 7 --no-cost
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from benchmarks.local_save import add_cost_args, local_save_cost
from benchmarks.recovery_runs import (
    SHAPES,
    WORLD,
    Kill,
    Outcome,
    checkpoint_differences,
    run,
)
from megatron3d.checkpoint.local.link import peer_of

ITERS = 10
SAVE_INTERVAL = 3  # global checkpoints, the fallback of a state lost everywhere
TARGET_S = 30.0  # the bound on kill -> next finished step


def _kill(rng: random.Random, pair: bool) -> Kill:
    rank = rng.randrange(WORLD)
    ranks = (rank, peer_of(rank, WORLD, WORLD)) if pair else (rank,)
    return Kill(ranks, rng.randint(2, ITERS - 3), rng.uniform(0.0, 0.3), lose_store=pair)


def _row(case: str, kill: Kill, reference: Outcome, faulty: Outcome, same_model: bool) -> str:
    same = (faulty.code == 0 and faulty.losses == reference.losses and not faulty.unstable
            and same_model)
    return (f"| {case} | {', '.join(map(str, kill.ranks))} after step {kill.after} | "
            f"{faulty.kill_to_step_s[0]:.1f} | {faulty.re_executed[0]} | "
            f"{'yes' if same else 'NO'} | {len(faulty.lost_notices)} |")


def _shape(shape: str, rng: random.Random, root: Path, pair_too: bool) -> list[str]:
    """The rows of one shape: its kill, and with ``pair_too`` the lost-replica case."""
    work = root / shape.replace(", ", "-")
    reference = run(work / "reference", shape, ITERS, SAVE_INTERVAL, [])
    if reference.code != 0:
        raise RuntimeError(f"the uninterrupted {shape} run failed:\n{reference.log[-3000:]}")
    rows = []
    for case, pair in [("one rank", False)] + ([("rank and replica lost", True)]
                                               if pair_too else []):
        kill = _kill(rng, pair)
        faulty = run(work / case.replace(" ", "-"), shape, ITERS, SAVE_INTERVAL, [kill])
        if faulty.code != 0:
            raise RuntimeError(f"{shape}, {case}: the job failed ({faulty.code}):\n"
                               f"{faulty.log[-3000:]}")
        same = not checkpoint_differences(work / "reference" / "ckpt",
                                          work / case.replace(" ", "-") / "ckpt")
        rows.append(_row(f"{shape}, {case}", kill, reference, faulty, same))
    return rows


def main(args: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=32)
    p.add_argument("--no-cost", action="store_true", help="skip the local-save cost")
    add_cost_args(p)  # the save cost's shape (benchmarks/local_save.py's defaults)
    a = p.parse_args(args)
    rng = random.Random(a.seed)
    lines = [f"seed {a.seed}; {WORLD} gloo workers, (tp 2, pp 2, dp 2), {ITERS} steps, a local "
             f"checkpoint every step, a global one every {SAVE_INTERVAL}",
             "| case | killed | kill to next step (s) | steps run again | bitwise equal | "
             "`notice:` lines |", "| --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory(prefix="m3d_recovery_") as root:
        for shape in SHAPES:
            lines += _shape(shape, rng, Path(root), pair_too=shape == "ZeRO-1")
    if not a.no_cost:
        with tempfile.TemporaryDirectory(prefix="m3d_local_", dir="/dev/shm") as root:
            cost = local_save_cost(a, a.world, root)
        lines.append(f"local save every step ({cost['machine']}; {a.world} ranks, hidden "
                     f"{a.hidden}, {a.layers} layers, seq {a.seq}, {a.accumulation} "
                     f"micro-batches of {a.micro_batch} per rank per step): median step "
                     f"{cost['baseline_s'] * 1e3:.1f} ms without, {cost['local_s'] * 1e3:.1f} "
                     f"ms with, ratio {cost['ratio']:.3f}")
    sys.stdout.write("\n".join(lines) + f"\n(target: kill to next step <= {TARGET_S:g} s, at "
                     "most one step run again, bitwise equal, a local save <= 5% of a step)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
