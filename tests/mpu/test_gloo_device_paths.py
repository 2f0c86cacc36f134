"""Ranks sharing a GPU over gloo, whose CUDA support is all-reduce and broadcast only:
``comm`` builds the all-gathers and reduce-scatters of TP and sequence parallelism from
all-reduces, and stages pipeline sends and receives through host memory. Those paths are
forced here on CPU tensors: TP with sequence parallelism and PP still train the same model as
one process (the GPU check runs them on CUDA tensors)."""

from __future__ import annotations

from megatron3d.mpu import comm, host_staging
from tests.helpers.dist import run_distributed
from tests.helpers.runs import assert_same_run, merge_ranks, reference_run, train
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

LAYOUTS = {"tp2-sp": ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
           "pp2": ("--pipeline-model-parallel-size", "2", "--pp-partition-method", "uniform")}


def _argv(*layout: str) -> list[str]:
    return train_argv("gpt2", 4, *EQUIVALENCE_FLAGS, *layout)


def _force_device_paths() -> dict[str, int]:
    """In this worker: every collective and exchange takes the device-tensor-on-gloo path
    (an exchange is staged once: its host copies are posted the ordinary way). Returns the
    counts of each path taken, filled as the run goes."""
    taken = {"gathers and scatters": 0, "staged exchanges": 0}
    staging, real_start = [], host_staging.start

    def on_device(_t: object, _axis: object) -> bool:
        taken["gathers and scatters"] += 1
        return True

    def start(sends: list, recvs: list, post: object) -> list:
        taken["staged exchanges"] += 1
        staging.append(True)
        try:
            return real_start(sends, recvs, post)
        finally:
            staging.pop()

    comm._gloo_on_device = on_device
    host_staging.start = start
    host_staging.needed = lambda _sends, _recvs, _axis: not staging
    return taken


def _run_forced() -> dict:
    taken, out = _force_device_paths(), {}
    for name, layout in LAYOUTS.items():
        taken.update(dict.fromkeys(taken, 0))
        out[name] = (train(_argv(*layout)), dict(taken))
    return out


def test_tp_sp_and_pp_through_the_gloo_device_paths_match_one_process():
    reference = reference_run(tuple(_argv()))
    per_rank = run_distributed(_run_forced, 2, timeout_s=180)
    for name in LAYOUTS:
        try:
            assert_same_run(merge_ranks([runs[name][0] for runs in per_rank]), reference, FP32)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err
    for runs in per_rank:
        assert runs["tp2-sp"][1]["gathers and scatters"] > 0
        assert runs["tp2-sp"][1]["staged exchanges"] == 0
        assert runs["pp2"][1]["staged exchanges"] > 0
