"""The phases of a rank's memory: which ones a run goes through, what the build holds under
ZeRO-3 (the whole stage, before it is sharded), and which NCCL communicators a rank pays
for."""

from __future__ import annotations

from megatron3d.accounting import overheads
from megatron3d.accounting.fit import layout_memory
from megatron3d.cli.arguments import parse_args
from tests.helpers.tiny import train_argv


def _cfg(*extra: str):
    return parse_args(train_argv("gpt2", 10, *extra))


def test_the_peak_is_over_the_phases_the_run_goes_through():
    rank = layout_memory(_cfg(), 1, "cpu")[0]
    assert [p.phase for p in rank.phases] == ["build", "train", "evaluate", "save"]
    assert rank.runs == ("build", "train", "evaluate")  # no --save: no save
    assert rank.phase("save").total > rank.total  # 64 MiB of staging, not counted here
    saving = layout_memory(_cfg("--save", "ckpt"), 1, "cpu")[0]
    assert saving.peak.phase == "save" and saving.total == rank.phase("save").total
    assert layout_memory(_cfg("--eval-iters", "0"), 1, "cpu")[0].runs == ("build", "train")


def test_each_rank_pays_for_the_communicators_it_uses():
    groups = overheads.nccl_groups(tp=4, pp=12, dp=8, tied=True, pp_rank=0)
    assert groups == {"world": 384, "tp": 4, "pp": 12, "dp": 8, "model-parallel": 48,
                      "embedding": 2}
    assert "embedding" not in overheads.nccl_groups(4, 12, 8, True, pp_rank=5)
    assert "embedding" not in overheads.nccl_groups(4, 12, 8, False, pp_rank=0)
    assert overheads.nccl_groups(1, 1, 1, True, 0) == {}  # one process: no NCCL
    assert overheads.nccl_bytes(groups) == (5 * overheads.NCCL_GROUP_BYTES
                                            + overheads.NCCL_PAIR_BYTES)
