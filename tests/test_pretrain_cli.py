"""pretrain_gpt.main as a launcher sees it: ``--print-topology`` makes every start-up check a
launch makes before its processes meet, then prints the rank table on rank 0 only and exits 0
without joining a process group or training; a world size that TP x PP does not divide, or any
other bad input, exits 2 with one line on stderr, before anything starts.

The launcher environment (WORLD_SIZE, RANK) is set with monkeypatch, so ``main`` runs in this
process exactly as it would under torchrun, minus the processes.
"""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

import pretrain_gpt
from tests.helpers.tiny import train_argv

ROW = re.compile(r"^ *(\d+) +(\d+) +(\d+) +(\d+)$")


def _launched_as(monkeypatch: pytest.MonkeyPatch, world_size: int, rank: int) -> None:
    """Pretend torchrun started this process; make any attempt to start training fail loudly."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))

    def must_not_run(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("--print-topology must exit before initialising or training")

    monkeypatch.setattr(pretrain_gpt.devices, "init_process_group", must_not_run)
    monkeypatch.setattr(pretrain_gpt, "build_trainer", must_not_run)


def _argv(tp: int, pp: int = 1, *extra: str) -> list[str]:
    return train_argv("gpt2", 10, "--tensor-model-parallel-size", str(tp),
                      "--pipeline-model-parallel-size", str(pp), *extra)


def _megatron_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) from rank = pp_rank*dp*tp + dp_rank*tp + tp_rank."""
    return rank % tp, rank // tp % dp, rank // (tp * dp)


@pytest.mark.parametrize(("world", "tp", "pp"), [(2, 2, 1), (4, 4, 1), (16, 2, 2), (8, 1, 4)])
def test_print_topology_prints_the_rank_table_and_exits(monkeypatch, capsys, world, tp, pp):
    """Any 3D layout the run fits prints."""
    _launched_as(monkeypatch, world_size=world, rank=0)
    assert pretrain_gpt.main(_argv(tp, pp, "--print-topology")) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    dp = world // (tp * pp)
    assert lines[0].startswith(f"world {world} = tp {tp} x dp {dp} x pp {pp}")
    assert lines[1].split() == ["rank", "tp", "dp", "pp"]
    rows = [tuple(int(v) for v in m.groups()) for m in map(ROW.match, lines) if m]
    assert rows == [(r, *_megatron_coords(r, tp, dp)) for r in range(world)]
    groups = " ".join(str(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp))
    assert f"tp groups: {groups}" in lines
    assert not any("iteration" in line for line in lines)
    assert not dist.is_initialized()


def test_print_topology_shows_the_context_parallel_axis(monkeypatch, capsys):
    """CP sits between TP and DP: world 8 = tp 2 x cp 2 x dp 2."""
    _launched_as(monkeypatch, world_size=8, rank=0)
    argv = _argv(2, 1, "--context-parallel-size", "2", "--attention-dropout", "0",
                 "--print-topology")
    assert pretrain_gpt.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("world 8 = tp 2 x cp 2 x dp 2 x pp 1")
    assert "cp groups: [0, 2] [1, 3] [4, 6] [5, 7]" in lines
    assert "dp-cp groups: [0, 2, 4, 6] [1, 3, 5, 7]" in lines


def test_print_topology_is_silent_off_rank_0(monkeypatch, capsys):
    _launched_as(monkeypatch, world_size=4, rank=1)
    assert pretrain_gpt.main(_argv(4, 1, "--print-topology")) == 0
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("world_size,tp", [(3, 2), (6, 4)])
def test_world_size_not_divisible_by_tp_x_pp_exits_2(monkeypatch, capsys, world_size, tp):
    _launched_as(monkeypatch, world_size=world_size, rank=0)
    assert pretrain_gpt.main(_argv(tp, 1, "--print-topology")) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("error: ")
    assert f"world size {world_size}" in err and "--tensor-model-parallel-size" in err


def _real_data(*extra: str) -> list[str]:
    """``_argv`` reading --data-path (with the null tokenizer) instead of mock data."""
    argv = _argv(*extra)
    argv.remove("--mock-data")
    return [*argv, "--tokenizer-type", "NullTokenizer"]


@pytest.mark.parametrize(("world", "argv", "named"), [
    (8, _argv(8, 1, "--num-attention-heads", "20", "--hidden-size", "160"),
     "--num-attention-heads=20, --tensor-model-parallel-size=8"),
    (2, _argv(1, 2, "--num-layers-per-virtual-pipeline-stage", "3"),
     "--num-layers-per-virtual-pipeline-stage=3 needs --num-layers 2"),
    (1, _real_data(1, 1, "--data-path", "/nonexistent/data/corpus_text_document"),
     "there is no directory /nonexistent/data"),
    (1, _argv(1, 1, "--load", "/nonexistent/ckpt", "--finetune"),
     "--finetune needs a checkpoint to load"),
])
def test_print_topology_runs_every_start_up_check(monkeypatch, capsys, world, argv, named):
    """What a launch would refuse after the queue wait, --print-topology (and so
    LAUNCH_DRY_RUN) refuses now: the whole validation, the data and checkpoint paths."""
    _launched_as(monkeypatch, world_size=world, rank=0)
    assert pretrain_gpt.main([*argv, "--print-topology"]) == 2
    assert named in _one_error_line(capsys)


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(("env", "named"), [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1'"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2, WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": "29500"}, "no MASTER_ADDR"),
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "h"}, "MASTER_PORT=''"),
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "abc"},
     "MASTER_PORT='abc'"),
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     "MASTER_PORT='70000'"),
])
def test_bad_launcher_environment_exits_2(monkeypatch, capsys, env, named):
    """A broken launcher environment is bad input like a bad flag, not a traceback or a hang."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(pretrain_gpt.devices, "init_process_group", _must_not_start)
    assert pretrain_gpt.main(train_argv("gpt2", 10)) == 2
    assert named in _one_error_line(capsys)


@pytest.mark.parametrize(("flags", "named"), [
    (["--lr", "inf"], "--lr=inf"),
    (["--lr", "1e400"], "--lr=inf"),
    (["--adam-eps", "inf"], "--adam-eps=inf"),
    (["--init-method-std=-inf"], "--init-method-std=-inf"),  # argparse: "-inf" alone is a flag
    (["--seed", str(2**70)], f"--seed={2**70}"),
    (["--seq-length", "50_000_000"], "--seq-length=50000000"),
    (["--split", "nan,1,1"], "--split='nan,1,1'"),
    (["--num-layers", "1000000"], "--num-layers=1000000"),
    (["--train-iters", str(2**40)], f"--train-iters={2**40}"),
    (["--num-layers", "64", "--hidden-size", "16384"],
     "the layout does not fit: out of memory: pipeline rank 0 needs"),
    (["--lr", "1e30"], "--lr=1e+30"),
    (["--init-method-std", "1e30"], "--init-method-std=1e+30"),
    (["--fp16", "--loss-scale", "1e30"], "--loss-scale=1e+30"),
    (["--fp16", "--initial-loss-scale", "1e30"], "--initial-loss-scale=1e+30"),
    # the CPU's math attention kernel (attention dropout) keeps [b, n, s, s] per layer
    (["--seq-length", "65536", "--attention-dropout", "0.1"],
     "the layout does not fit: out of memory: pipeline rank 0 needs"),
])
def test_non_finite_or_absurd_numbers_exit_2(monkeypatch, capsys, flags, named):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(pretrain_gpt.devices, "init_process_group", _must_not_start)
    assert pretrain_gpt.main(train_argv("gpt2", 10, *flags)) == 2
    assert named in _one_error_line(capsys)


@pytest.mark.parametrize(("flags", "named"), [
    (["--hang-load-timeout", "900"], "--hang-load-timeout=900.0, --distributed-timeout-minutes=10"),
    (["--hang-startup-timeout", "1800", "--distributed-timeout-minutes", "20"],
     "--hang-startup-timeout=1800.0, --distributed-timeout-minutes=20"),
])
def test_a_watchdog_budget_over_the_process_group_timeout_exits_2(monkeypatch, capsys, flags,
                                                                  named):
    """The backend would abort first and no hang dump would be written: refused at start."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(pretrain_gpt.devices, "init_process_group", _must_not_start)
    assert pretrain_gpt.main(train_argv("gpt2", 10, *flags)) == 2
    line = _one_error_line(capsys)
    assert named in line and "or raise --distributed-timeout-minutes" in line, line


def _must_not_start(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("bad input must stop before the process group starts")


def test_an_error_met_during_evaluation_is_one_line(monkeypatch, capsys):
    """The one error path covers evaluation too: exit 2, one line, no traceback."""
    from megatron3d.errors import DataError
    from megatron3d.training import loop

    def broken(*args, **kwargs):
        raise DataError("validation batch 0 holds token id 999 >= vocabulary 203: rebuild it")

    monkeypatch.setattr(loop, "evaluate", broken)
    assert pretrain_gpt.main(train_argv("gpt2", 3, "--eval-interval", "2")) == 2
    err = capsys.readouterr().err  # stdout holds the start-up log and two iteration lines
    assert err.startswith("error: ") and err.count("\n") == 1 and "token id 999" in err, err
