"""Sharded initialisation, measured: a TP=4 rank's peak host memory growth up to the first
step is at most 0.3x a TP=1 rank's for a vocabulary-heavy model (issue 17). Drawing each full
weight and slicing it gives about 0.7 for this model.

Each rank reads its own peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` before
the build), so the figure covers every allocation, not only Python's or torch's allocator.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.runs import build

# A 131,072 x 256 embedding (128 MiB in fp32, tied) against one small layer.
VOCAB_HEAVY = ["--num-layers", "1", "--hidden-size", "256", "--num-attention-heads", "4",
               "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
               "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", "131072"]
MAX_RATIO = 0.3  # the acceptance bound


def _status_bytes(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(),
                         re.M)[1]) * 1024


def _peak_growth(tp: int) -> int:
    """Bytes of peak RSS above the RSS at the start of building the trainer. A small build
    first faults in the code and imports a build touches (a worker forked from the fork
    server maps the server's library pages again as it uses them), which costs every TP
    size alike and would blur the ratio."""
    layout = ["--tensor-model-parallel-size", str(tp)]
    build([*VOCAB_HEAVY, "--vocab-size", "1024", *layout])
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = _status_bytes("VmRSS")
    build([*VOCAB_HEAVY, *layout])
    return _status_bytes("VmHWM") - start


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _can_reset_peak(), reason="needs Linux's /proc/self/clear_refs")
def test_a_tp4_rank_grows_at_most_0_3x_a_tp1_rank():
    single = run_distributed(_peak_growth, 1, 1, timeout_s=120)[0]
    per_rank = run_distributed(_peak_growth, 4, 4, timeout_s=120)
    ratio = max(per_rank) / single
    assert ratio <= MAX_RATIO, (f"TP=4 ranks grew {[b >> 20 for b in per_rank]} MiB, TP=1 "
                                f"{single >> 20} MiB: ratio {ratio:.2f}")
