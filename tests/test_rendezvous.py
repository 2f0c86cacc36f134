"""Joining the job never waits for the collective timeout: a stray WORLD_SIZE, an address
nobody answers at or that does not resolve, and a busy MASTER_PORT each stop the process with
exit code 2 and one ``error:`` line naming the variable, within ``--rendezvous-timeout``.

``main`` runs in this process as torchrun would run one rank (the launcher environment set
with monkeypatch); stderr is captured at the file descriptor, where torch's C++ store would
print its own warnings.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

import pretrain_gpt
from tests.helpers.tiny import train_argv

TIMEOUT_S = 1.0  # --rendezvous-timeout in these tests
BOUND_S = 30.0  # far below the 10-minute collective timeout the rendezvous used to wait for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def _launched(monkeypatch: pytest.MonkeyPatch, rank: int, addr: str, port: int) -> None:
    """This process as rank ``rank`` of two, with a rendezvous at ``addr:port``."""
    for name, value in {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0",
                        "MASTER_ADDR": addr, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("MEGATRON3D_EXIT_DIR", raising=False)

    def must_not_run(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a failed rendezvous must stop before building anything")

    monkeypatch.setattr(pretrain_gpt, "build_trainer", must_not_run)


def _refused(capfd: pytest.CaptureFixture[str], *named: str) -> None:
    started = time.monotonic()
    assert pretrain_gpt.main(train_argv("gpt2", 3, "--rendezvous-timeout",
                                        str(TIMEOUT_S))) == 2
    assert time.monotonic() - started < BOUND_S
    out, err = capfd.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(name in err for name in named), err
    assert not dist.is_initialized()


def test_a_stray_world_size_stops_rank_0_within_the_rendezvous_timeout(monkeypatch, capfd):
    """One process launched with WORLD_SIZE=2 by mistake: nobody else ever joins."""
    _launched(monkeypatch, 0, "127.0.0.1", _free_port())
    _refused(capfd, "WORLD_SIZE=2", "1 of 2 ranks", "--rendezvous-timeout")


def test_a_rank_finding_no_rank_0_stops_within_the_rendezvous_timeout(monkeypatch, capfd):
    port = _free_port()
    _launched(monkeypatch, 1, "127.0.0.1", port)
    _refused(capfd, f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}", "--rendezvous-timeout")


def test_an_unresolvable_master_addr_is_named_at_once(monkeypatch, capfd):
    _launched(monkeypatch, 1, "no-such-host.invalid", _free_port())
    _refused(capfd, "MASTER_ADDR='no-such-host.invalid'")


def test_a_busy_master_port_is_one_line(monkeypatch, capfd, busy_port):
    _launched(monkeypatch, 0, "127.0.0.1", busy_port)
    _refused(capfd, f"MASTER_PORT={busy_port}", "in use")


def test_each_torchrun_restart_of_the_workers_gets_its_own_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's store outlives the workers it restarts: the restarted workers must not read
    the keys their predecessors wrote (gloo's addresses of dead processes, a posted failure)."""
    from megatron3d import rendezvous

    port = _free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    seen = []
    for attempt in ("0", "1", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        store = rendezvous.join(0, 1, TIMEOUT_S)
        seen.append(store.check(["megatron3d/test"]))
        store.set("megatron3d/test", attempt)
    assert seen == [False, False, True]
    del agent
