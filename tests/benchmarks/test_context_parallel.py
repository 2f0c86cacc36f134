"""The pure parts of ``benchmarks/context_parallel.py``: the balance table (brute force over
the real layout, agreeing with the accounting), the memory and step-time rows and their
verdicts, and the trainer command lines (equal tokens per rank at DP=2 and CP=2)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.context_parallel import (
    _args,
    balance_rows,
    brute_force_pairs,
    median_ms,
    memory_rows,
    model_config,
    step_rows,
)
from benchmarks.context_parallel_runs import layer_saved_bytes, trainer_argv
from megatron3d.accounting.activations import layer_activation_bytes
from megatron3d.cli.arguments import parse_args
from tests.helpers.dist import run_distributed


def test_the_layout_balances_causal_work_and_contiguous_shards_do_not():
    assert brute_force_pairs(8, 2) == [18, 18]  # chunks {0, 3} and {1, 2} of 2 tokens
    rows = balance_rows(64, [2, 4])
    assert "1.000 <= 1.05 ok" in rows[1] and "1.000 <= 1.05 ok" in rows[2]
    contiguous = [float(row.split()[-1]) for row in rows[1:]]
    assert contiguous[0] > 2 and contiguous[1] > 4


def test_memory_rows_judge_each_ratio_against_one_over_c():
    a = _args(["--cp", "2", "--seq", "64", "--hidden", "32", "--heads", "4"])
    assert a.cp == [1, 2]
    cfg = model_config(a)
    base = sum(layer_activation_bytes(cfg, a.micro_batch, 1, False, torch.bfloat16,
                                      "cpu").values())
    rows = memory_rows(cfg, a.micro_batch, {(1, "p2p"): base, (2, "p2p"): base // 2,
                                            (2, "all_gather"): base})
    assert rows[1].split()[:4] == ["1", "-", f"{base:,}", "1.000"]
    by_comm = {row.split()[1]: row for row in rows[2:]}
    assert by_comm["p2p"].endswith("1.000 ok") and "0.500" in by_comm["p2p"]
    assert by_comm["all_gather"].endswith("MISSED")


def test_step_rows_take_the_slower_rank_and_the_median():
    ranks = [{"DP=2": [0.010, 0.030, 0.020], "CP=2 p2p": [0.011, 0.011, 0.012]},
             {"DP=2": [0.012, 0.010, 0.020], "CP=2 p2p": [0.013, 0.040, 0.010]}]
    assert median_ms(ranks, "DP=2") == pytest.approx(20.0)
    assert median_ms(ranks, "CP=2 p2p") == pytest.approx(13.0)
    rows = step_rows(ranks, "DP=2")
    assert "0.650 x DP=2 ok" in rows[1]


def test_trainer_runs_hold_the_same_tokens_per_rank():
    a = _args(["--seq", "64", "--hidden", "32", "--heads", "4", "--layers", "2"])
    dp = parse_args(trainer_argv(a, 1, "p2p", 3))
    cp = parse_args(trainer_argv(a, 2, "a2a", 3))
    assert (cp.parallel.context_parallel_size, cp.parallel.cp_comm_type) == (2, "a2a")
    assert dp.parallel.context_parallel_size == 1
    assert dp.training.global_batch_size == cp.training.global_batch_size
    tokens = [c.training.micro_batch_size * c.model.seq_length // c.parallel.context_parallel_size
              for c in (dp, cp)]
    assert tokens[0] == tokens[1]


def _saved(cp: int, comm: str, argv: list[str]) -> list[int]:
    return layer_saved_bytes(_args(argv), cp, comm)


def test_each_exchange_keeps_what_the_accounting_says_and_no_more():
    """Measured on 2 ranks (saved-tensor hooks over one layer's forward): p2p and a2a keep
    exactly the accounting's bytes, half of CP = 1 plus a2a's token order (a2a's output is
    kept once: the kernel's head-sharded copy is traded back in backward, not kept)."""
    argv = ["--layers", "1", "--hidden", "64", "--heads", "4", "--seq", "64",
            "--micro-batch", "2"]
    cfg = model_config(_args(argv))
    whole = layer_saved_bytes(_args(argv), 1, "p2p")[0]
    for comm in ("p2p", "a2a"):
        ranks = run_distributed(_saved, 2, 2, comm, argv)
        predicted = sum(layer_activation_bytes(cfg, 2, 1, False, torch.bfloat16, "cpu", 2,
                                               comm).values())
        assert [r[0] for r in ranks] == [predicted] * 2, comm
        assert predicted <= whole / 2 + 8 * 64, comm
