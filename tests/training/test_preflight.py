"""Pre-flight configuration agreement: a rank launched with other flags fails every rank,
before the model is built, with one line naming the flags."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron3d.cli.arguments import parse_args
from megatron3d.errors import ConfigError
from megatron3d.mpu.state import ParallelState
from megatron3d.training import preflight
from tests.helpers.dist import run_distributed
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

CPU = torch.device("cpu")


def _error(fn, *args) -> str | None:
    """The ConfigError message ``fn`` raised on this rank, or None if it passed."""
    try:
        fn(*args)
    except ConfigError as err:
        return str(err)
    return None


def _scenarios() -> dict[str, str | None]:
    """Every case on the same 4 ranks; each rank reports what it raised."""
    rank = torch.distributed.get_rank()
    argv = train_argv("gpt2", 3)
    world = ParallelState.build(1, 1).world

    def check(*extra: str) -> str | None:
        return _error(preflight.check_same_config, parse_args([*argv, *extra]), world, CPU)

    fields = preflight.flat_fields(parse_args(argv))
    with mock.patch.object(preflight, "flat_fields",  # rank 1 runs code that knows one more flag
                           return_value={**fields, "new_flag": 1} if rank == 1 else fields):
        newer_code = check()
    many = ("--seed", "7", "--lr", "1e-3", "--min-lr", "0", "--clip-grad", "2",
            "--weight-decay", "0", "--adam-eps", "1e-6")
    return {
        "same": check(),
        # Through the trainer's build: it must stop before building a model of another size.
        "hidden": _error(build, [*argv, *(["--hidden-size", "64"] if rank == 3 else [])]),
        "split": check(*(["--seed", "7", "--lr", "1e-3"] if rank >= 2 else [])),
        "many": check(*(many if rank == 0 else ())),
        "newer_code": newer_code,
        "fields": len(fields),
    }


def test_every_rank_names_the_differing_flags():
    per_rank = run_distributed(_scenarios, 4, timeout_s=120)
    for rank, result in enumerate(per_rank):
        assert result["same"] is None, rank
        assert result["hidden"] == (
            "ranks were launched with different flags: --hidden-size differs (this rank "
            f"{64 if rank == 3 else 32}; ranks 0-2 agree, rank 3 differs): launch every rank "
            "with the same command"), rank
        seed = 7 if rank >= 2 else 1234
        assert f"--seed differs (this rank {seed}; ranks 0-1 agree, ranks 2-3 differ); " \
            "--lr differs" in result["split"], rank
        assert "ranks 1-3 agree, rank 0 differs" in result["many"], rank
        assert result["many"].count("differs (") == preflight._SHOWN, rank
        assert "; and 2 more: launch every rank" in result["many"], rank
        n = result["fields"]
        assert result["newer_code"] == (
            f"ranks run different code versions (between {n} and {n + 1} config fields, this "
            f"rank {n + (rank == 1)}): install the same megatron3d on every node"), rank


def test_one_process_always_agrees():
    preflight.check_same_config(parse_args(train_argv("gpt2", 3)),
                                ParallelState.single().world, CPU)


@pytest.mark.parametrize(("ranks", "text"), [([3], "rank 3"), ([0, 1, 2], "ranks 0-2"),
                                             ([0, 2, 3, 5], "ranks 0, 2-3, 5")])
def test_rank_lists_read_as_ranges(ranks, text):
    assert preflight._ranks(ranks) == text


def test_two_ranks_that_disagree_read_as_one_against_the_other():
    assert preflight._describe("hidden_size", 32, [111, 222]) == (
        "--hidden-size differs (this rank 32; rank 0 has one value, rank 1 differs)")
