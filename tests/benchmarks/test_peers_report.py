"""benchmarks/peers' report without the peers installed: collectives counted whatever
issues them, repeated runs pooled, the speed targets met or missed with the margin, the
README section and chart written, and the whole report path of ``compare`` on fake rows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

from benchmarks.peers import chart, compare, readme
from benchmarks.peers.comm_count import CommCounter, message_bytes
from benchmarks.peers.config import REFERENCE, Row, run_order
from benchmarks.peers.runner import RowResult
from benchmarks.peers.table import (
    disagreeing,
    format_tables,
    paired_ratios,
    ratio,
    summarise_all,
)
from benchmarks.peers.targets import check_targets
from tests.helpers.dist import run_distributed

OURS_DP = Row(framework="megatron3d", variant="ZeRO-0", dp=2, options=(("zero", "0"),),
              baseline="ZeRO-0")
DDP = Row(framework="pytorch", variant="DDP", dp=2, baseline="ZeRO-0")
MCORE_DP = Row(framework="megatron-core", variant="DDP", dp=2, baseline="ZeRO-0")
LOSSES = [7.0, 6.5, 6.0]


def _run(row: Row, step_s: float, losses: list[float] = LOSSES) -> RowResult:
    times = [[step_s] * len(losses)] * row.world_size
    return RowResult(row, losses=[losses], times=[times], peak_rss=[2**20] * row.world_size,
                     comm=[{"calls": 3, "bytes": 2**20}] * row.world_size)


def _count_every_kind() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    counter = CommCounter()
    x = torch.ones(256)  # 1 KiB
    with counter:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(256 * world_size), x)  # counted at 2 KiB
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        functional.all_reduce(x, "sum", dist.group.WORLD).wait()  # DTensor's kind
        model = torch.nn.Linear(16, 16)  # no collective: not counted
        model(torch.ones(2, 16)).sum().backward()
    return {"calls": counter.tally.calls, "bytes": counter.tally.bytes}


def test_collectives_and_messages_are_counted_at_their_largest_buffer():
    tallies = run_distributed(_count_every_kind, 2)
    assert tallies == [{"calls": 4, "bytes": 1024 + 2048 + 1024 + 1024}] * 2


def test_a_coalesced_call_counts_all_its_tensors():
    outputs, inputs = [torch.empty(8), torch.empty(4)], [torch.empty(4), torch.empty(2)]
    assert message_bytes((outputs, inputs, "group"), None) == 12 * 4
    assert message_bytes((torch.empty(3),), torch.empty(6)) == 24  # a functional output


def test_repeated_runs_pool_their_times_and_every_run_is_loss_checked():
    reference = _run(REFERENCE, 1.0)
    slow_second = _run(DDP, 0.5).add_run(_run(DDP, 0.8)).add_run(_run(DDP, 0.9))
    summary = summarise_all([reference, slow_second], warmup=1)[id(slow_second)]
    assert summary.step_ms == pytest.approx(800.0)  # median of 0.5, 0.5, 0.8, 0.8, 0.9, 0.9
    assert summary.step_text() == "800.0 (500-900)"  # and the spread of the runs' medians
    off = _run(DDP, 0.5).add_run(_run(DDP, 0.5, [7.0, 6.5, 6.01]))
    assert disagreeing([reference, off], warmup=1) == ["pytorch DDP (1,1,2)"]
    failed = RowResult(DDP, reason="timed out")
    assert _run(DDP, 0.5).add_run(failed).reason == "timed out"


def test_int8_rows_are_not_held_to_the_fp32_agreement():
    """Their bound is the 300-step benchmark's; an fp32 row off by as much is flagged."""
    reference = _run(REFERENCE, 1.0)
    int8 = Row(framework="megatron3d", variant="ZeRO-3 int8", dp=2,
               options=(("zero", "3"), ("zero3-quantize-grads", "1")), baseline="ZeRO-3")
    fp32 = Row(framework="megatron3d", variant="ZeRO-3", dp=2, options=(("zero", "3"),))
    off = [7.0, 6.5, 6.01]
    assert disagreeing([reference, _run(int8, 0.5, off), _run(fp32, 0.5, off)],
                       warmup=1) == ["megatron3d ZeRO-3 (1,1,2)"]


def test_ratios_pair_the_runs_of_one_round():
    """The machine's speed drifts between rounds: round 1 ran everything slowly, and in
    round 2 the peer was slower than megatron3d. Paired, the rounds say 0.55 and 1.8;
    pooling every step would compare the peer's slow round with our fast one."""
    ours = _run(OURS_DP, 1.0).add_run(_run(OURS_DP, 0.5))
    peer = _run(DDP, 0.55).add_run(_run(DDP, 0.9))
    results = [_run(REFERENCE, 1.0), ours, peer]
    summaries = summarise_all(results, warmup=1)
    assert paired_ratios(peer, results, summaries) == pytest.approx([0.55, 1.8])
    assert ratio(peer, results, summaries) == pytest.approx(1.175)
    assert "| 1.18 (0.55-1.80) |" in format_tables(results, warmup=1)


def test_rounds_run_a_layouts_rows_back_to_back():
    ours_pp = Row(framework="megatron3d", variant="1F1B", pp=2, baseline="1F1B")
    torch_pp = Row(framework="pytorch", variant="pipelining 1F1B", pp=2, baseline="1F1B")
    order = run_order([REFERENCE, OURS_DP, ours_pp, DDP, torch_pp, MCORE_DP])
    assert order == [REFERENCE, OURS_DP, DDP, MCORE_DP, ours_pp, torch_pp]


def test_targets_say_met_or_missed_with_the_margin():
    results = [_run(REFERENCE, 1.0), _run(OURS_DP, 0.5), _run(DDP, 0.45),
               _run(MCORE_DP, 0.6),
               RowResult(Row(framework="pytorch", variant="FSDP2", dp=2, baseline="ZeRO-3"),
                         reason="crashed")]
    lines = check_targets(results, warmup=1)
    assert ("- met: megatron3d <= Megatron-Core, megatron-core DDP at (1,1,2): the peer "
            "takes 1.20x our step time") in lines
    assert ("- MISSED: DP within 5% of PyTorch DDP, pytorch DDP at (1,1,2): the peer takes "
            "0.90x our step time (megatron3d is 5.6% slower than the target allows)") in lines
    assert "- not measured: ZeRO-3 <= FSDP2, pytorch FSDP2 at (1,1,2): crashed" in lines


def test_the_readme_section_is_replaced_between_its_markers(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(f"# top\nhand written\n{readme.BEGIN}\nold table\n{readme.END}\nafter\n")
    readme.replace_section(path, "new table\n")
    assert path.read_text() == (f"# top\nhand written\n{readme.BEGIN}\nnew table\n"
                                f"{readme.END}\nafter\n")
    path.write_text("no markers\n")
    with pytest.raises(ValueError, match="add the two markers"):
        readme.replace_section(path, "x")


def test_the_chart_says_why_it_was_not_drawn(monkeypatch, tmp_path):
    monkeypatch.setattr(chart.importlib.util, "find_spec", lambda name: None)
    modes = [("unlimited", [_run(REFERENCE, 1.0)])]
    assert "matplotlib not installed" in chart.draw(modes, 1, "t", tmp_path / "c.png")
    assert not (tmp_path / "c.png").exists()


def test_the_chart_is_a_png_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    modes = [(m, [_run(REFERENCE, 1.0), _run(DDP, 0.5)]) for m in ("a", "b")]
    assert chart.draw(modes, 1, "t", tmp_path / "c.png") == ""
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_runs_rounds_reports_targets_and_writes_the_readme(monkeypatch, tmp_path,
                                                                   capsys):
    rows = [REFERENCE, OURS_DP, DDP]
    calls = []

    def fake_run_row(row, run_dir, row_dir, timeout_s, prefix, profile, nodes=None):
        calls.append((row.label, row_dir.name, profile))
        return _run(row, {REFERENCE: 1.0, OURS_DP: 0.5, DDP: 0.45}[row])

    monkeypatch.setattr(compare, "all_rows", lambda: rows)
    monkeypatch.setattr(compare, "run_row", fake_run_row)
    monkeypatch.setattr(compare, "README", tmp_path / "README.md")
    monkeypatch.setattr(compare, "CHART", tmp_path / "chart.png")
    monkeypatch.setattr(chart.importlib.util, "find_spec", lambda name: None)
    (tmp_path / "README.md").write_text(f"{readme.BEGIN}\n{readme.END}\n")
    argv = ["--repeat", "2", "--profile", "--write-readme", "--work-dir", str(tmp_path / "w")]
    assert compare.main(argv) == 0
    assert [c[1] for c in calls] == ["row00-run0", "row01-run0", "row02-run0",
                                     "row00-run1", "row01-run1", "row02-run1"]
    assert [c[2] for c in calls] == [True] * 3 + [False] * 3  # one profile per row
    out = capsys.readouterr().out
    assert "MISSED: DP within 5% of PyTorch DDP" in out
    written = (tmp_path / "README.md").read_text()
    assert "--repeat 2 --profile --write-readme" in written and "2 run(s) per row" in written
    assert "| pytorch | DDP | 450.0 (450-450) | 0.90 (0.90-0.90) |" in written
    assert "Chart not drawn: matplotlib not installed" in written
