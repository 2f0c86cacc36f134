"""--distributed-backend: gloo or NCCL, checked against the machine before any process group.
GPUs are faked (``devices.gpu_count``): the rules are arithmetic on the launcher's numbers."""

from __future__ import annotations

import pytest
import torch

import pretrain_gpt
from megatron3d import device as devices
from megatron3d.cli.arguments import parse_args
from megatron3d.errors import ConfigError
from tests.helpers.tiny import train_argv


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(devices, "gpu_count", lambda: count)
    monkeypatch.setattr(devices, "accelerator_available", lambda: count > 0)


def _env(local_rank: int) -> devices.LaunchEnv:
    return devices.LaunchEnv(rank=local_rank, world_size=4, local_rank=local_rank, launched=True)


def test_the_flag_is_parsed_and_its_values_checked():
    assert parse_args(train_argv("gpt2", 2)).parallel.distributed_backend is None
    cfg = parse_args(train_argv("gpt2", 2, "--distributed-backend", "gloo"))
    assert cfg.parallel.distributed_backend == "gloo"
    with pytest.raises(ConfigError, match=r"--distributed-backend='mpi'\): expected one of "
                                          r"nccl, gloo"):
        parse_args(train_argv("gpt2", 2, "--distributed-backend", "mpi"))


@pytest.mark.parametrize(("gpus", "requested", "chosen"), [
    (0, None, "gloo"), (0, "gloo", "gloo"), (2, None, "nccl"), (2, "nccl", "nccl"),
    (2, "gloo", "gloo"),
])
def test_the_backend_follows_the_flag_or_the_device(monkeypatch, gpus, requested, chosen):
    _gpus(monkeypatch, gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert devices.resolve_backend(requested, _env(1)) == chosen


def test_nccl_without_gpus_is_one_line(monkeypatch):
    _gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="needs CUDA GPUs and this machine has none"):
        devices.resolve_backend("nccl", _env(0))


@pytest.mark.parametrize("requested", [None, "nccl"])
def test_nccl_refuses_ranks_sharing_a_gpu(monkeypatch, requested):
    _gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"NCCL cannot run two ranks on one GPU \(4 ranks per "
                                          r"GPU .*--distributed-backend gloo"):
        devices.resolve_backend(requested, _env(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # without it, a LOCAL_RANK past the GPUs shows it
    assert devices.resolve_backend(requested, _env(0)) == "nccl"
    with pytest.raises(ConfigError, match="NCCL cannot run two ranks on one GPU"):
        devices.resolve_backend(requested, _env(1))


def test_ranks_outnumbering_the_gpus_share_them_round_robin(monkeypatch):
    _gpus(monkeypatch, 2)
    assert [devices.device(r) for r in range(4)] == [torch.device("cuda", g)
                                                     for g in (0, 1, 0, 1)]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert devices.ranks_per_gpu(_env(3)) == 2


def test_pretrain_refuses_nccl_on_this_cpu_machine_before_starting(monkeypatch, capsys):
    _gpus(monkeypatch, 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def must_not_start(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("bad input must stop before the process group starts")

    monkeypatch.setattr(pretrain_gpt.devices, "init_process_group", must_not_start)
    assert pretrain_gpt.main(train_argv("gpt2", 5, "--distributed-backend", "nccl")) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: --distributed-backend nccl needs CUDA GPUs")
