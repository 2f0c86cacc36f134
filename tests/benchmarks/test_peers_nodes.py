"""benchmarks/peers on emulated nodes without running them: which rows fit the nodes and
the launch through scripts/local_nodes.sh, the node rows' flags, the bytes from other nodes
in the report and the node targets met or missed."""

from __future__ import annotations

import subprocess

from benchmarks.peers import compare, nodes, runner
from benchmarks.peers.config import REFERENCE, Row, build_config, node_rows
from benchmarks.peers.nodes import EmulatedNodes
from benchmarks.peers.run_megatron3d import megatron3d_argv
from benchmarks.peers.runner import RowResult
from benchmarks.peers.table import cross_node_lines
from benchmarks.peers.targets import node_targets

ROWS = {r.label: r for r in node_rows()}
FLAT, HPZ = ROWS["megatron3d ZeRO-3"], ROWS["megatron3d ZeRO-3 secondary shard int8"]
HSDP = ROWS["pytorch FSDP2 hybrid"]


def _run(row: Row, step_s: float, across: int | None = None) -> RowResult:
    return RowResult(row, losses=[[7.0, 6.0]], times=[[[step_s] * 2] * row.world_size],
                     peak_rss=[1] * row.world_size, comm=[{"calls": 1, "bytes": 1}],
                     cross_node=[across] * row.world_size)


def test_node_rows_are_two_nodes_of_two_with_their_flags():
    argv = megatron3d_argv(build_config(quick=True), HPZ)
    assert argv[argv.index("--gpus-per-node") + 1] == "2"
    assert argv[argv.index("--zero3-secondary-shard") + 1] == "node"
    assert "--zero3-quantize-weights" in argv and "--zero3-quantize-grads" in argv
    assert HSDP.option("nodes") == "2" and all(r.world_size == 4 for r in ROWS.values())


def test_rows_of_n_by_k_ranks_launch_through_local_nodes(monkeypatch, tmp_path):
    two = EmulatedNodes(2, "2gbit")
    assert two.fits(FLAT) and not two.fits(REFERENCE)
    assert not two.fits(Row(framework="megatron3d", variant="ZeRO-3", dp=2))  # 1 per node
    ran = []

    def fake_run(cmd, **kwargs):
        ran.append((cmd, kwargs["env"]))
        kwargs["stdout"].write("RuntimeError: no namespaces here\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    result = runner.run_row(HSDP, tmp_path, tmp_path / "row", 5.0, nodes=two)
    cmd, env = ran[0]
    assert cmd[:2] == ["bash", str(nodes.SCRIPT)]
    assert cmd[2:cmd.index("--")] == ["--nodes", "2", "--ranks-per-node", "2",
                                      "--link-rate", "2gbit"]
    assert cmd[cmd.index("--") + 1:][:2] == ["-m", "benchmarks.peers.run_torch"]
    assert env["PYTHON"] and result.reason.startswith("RuntimeError: no namespaces here")


def test_the_mode_says_why_it_is_skipped(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(compare, "emulation_unavailable", lambda: "needs root")
    monkeypatch.setattr(compare, "run_row", lambda *a, **k: 1 / 0)  # nothing runs
    assert compare.main(["--emulated-nodes", "2", "--work-dir", str(tmp_path)]) == 0
    assert ("2 emulated nodes, links of 2gbit between them (scripts/local_nodes.sh): "
            "skipped, needs root") in capsys.readouterr().out


def test_bytes_from_other_nodes_and_the_node_targets():
    hybrid = ROWS["megatron3d ZeRO-3 hybrid"]
    results = [_run(REFERENCE, 1.0), _run(FLAT, 1.0, 6_000_000), _run(hybrid, 0.7, 2_000_000),
               _run(HPZ, 0.5, 500_000), _run(HSDP, 0.55), _run(ROWS["pytorch FSDP2"], 0.9)]
    assert cross_node_lines(results) == [
        "- megatron3d ZeRO-3 (1,1,4): 6.000 MB", "- megatron3d ZeRO-3 hybrid (1,1,4): 2.000 MB",
        "- megatron3d ZeRO-3 secondary shard int8 (1,1,4): 0.500 MB"]
    assert node_targets(results, warmup=0) == [
        "- met: best node mode (ZeRO-3 secondary shard int8) <= 0.6x megatron3d ZeRO-3 at "
        "(1,1,4): ours takes 0.50x its step time",
        "- met: best node mode (ZeRO-3 secondary shard int8) <= 1x pytorch FSDP2 hybrid at "
        "(1,1,4): ours takes 0.91x its step time"]
    results[3] = _run(HPZ, 0.65)
    lines = node_targets(results, warmup=0)
    assert lines[0].startswith("- MISSED: best node mode (ZeRO-3 secondary shard int8) <= 0.6x")
    assert lines[1].endswith("ours takes 1.18x its step time") and "MISSED" in lines[1]
