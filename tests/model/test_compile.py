"""--compile: compiled layers train the eager model (fp32 tolerance) at (1,1,1), (2,2,2) ZeRO-1
and (1,1,4) ZeRO-3, a layer is one graph at TP = 1 and breaks only at its collectives under
TP, nothing recompiles during a run (batch-size rampup included), and a compiled run with
dropout resumes bitwise and recomputes the masks it drew.

torch.compile is slow on 2 shared cores: every run here compiles into one cache directory
per user that outlives the session (``tests/helpers/compile_cache.py``), so only the first
run of this file is cold, and tests share graphs where they can: a cold graph costs every rank
that needs it a compile at the same time.
"""

from __future__ import annotations

import dataclasses
import re
from unittest import mock

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

from megatron3d.model import transformer
from megatron3d.model.transformer import TransformerLayer
from megatron3d.mpu import traffic
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.training.build import Overrides
from megatron3d.training.loop import Hooks
from tests.helpers.compile_cache import CACHE
from tests.helpers.dist import run_distributed
from tests.helpers.runs import assert_same_run, merge_ranks, reference_run, train, train_single
from tests.helpers.tiny import layer_context, model_config, ramp_argv, train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

COMPILE = ("--compile", "--compile-cache-dir", CACHE)
GQA = ("--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2")
RAMP = ("16", "8", "8", "16")  # global batch 8 -> 16 after 16 samples: step 3 grows it
DROPOUT = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
HIDDEN_DROPOUT = ("--hidden-dropout", "0.1")


def _argv(flavour: str, *extra: str) -> tuple[str, ...]:
    return tuple(ramp_argv(flavour, 5, RAMP, *EQUIVALENCE_FLAGS, *extra))


LAYOUTS = {  # flavour, extra flags (at world 1 the reference's too), world size
    # hidden dropout: on the CPU inductor calls torch's dropout (fallback_random), which
    # draws eager's masks from the default generator, so compiled == eager holds with it on
    "111-gpt2": ("gpt2", HIDDEN_DROPOUT, 1),
    "222-zero1-bloom": ("bloom", ("--tensor-model-parallel-size", "2",
                                  "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
                                  "--pp-partition-method", "uniform"), 8),
    "114-zero3-llama-gqa": ("llama", ("--zero-stage", "3", *GQA), 4),
}


def _layer(flavour: str, tp: AxisGroup | None = None, sequence_parallel: bool = False,
           **changes) -> TransformerLayer:
    cfg = model_config(flavour, **{"hidden_dropout": 0.1, "attention_dropout": 0.1,
                                   "compile": True, **changes})
    rank = tp.rank if tp else 0
    ctx = dataclasses.replace(layer_context(cfg, tp=tp), sequence_parallel=sequence_parallel,
                              rng=RNGStreams.create(1, rank, 0, torch.device("cpu")))
    return TransformerLayer(ctx, 0).train()


@pytest.mark.parametrize("flavour", ["gpt2", "bloom", "llama"])
@pytest.mark.parametrize("recompute", [None, "selective"])
def test_a_layer_is_one_graph_at_tp1(flavour, recompute):
    """Dropout on (attention dropout too: at TP = 1 it needs no stream switch)."""
    extra = {"num_attention_heads": 8, "group_query_attention": True,
             "num_query_groups": 2} if flavour == "llama" else {}
    layer = _layer(flavour, recompute_granularity=recompute, **extra)
    x = torch.randn(16, 2, 32, requires_grad=True)
    explained = dynamo.explain(layer._block)(x, None)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _aot_eager(fn):
    return torch.compile(fn, backend="aot_eager", dynamic=False)


def _tp2() -> list[tuple[set[str], dict, dict]]:
    """Without and with SP: the functions a compiled layer breaks at, and what ``comm`` was
    told of two forward and backward passes of the compiled layer and of the same eager.
    Compiled by dynamo and AOT autograd without inductor's code generation (``aot_eager``):
    where a layer breaks and what runs eagerly between its regions is dynamo's doing, and
    inductor's kernels under TP are the (2,2,2) layout's test; cold, they would cost every
    rank a compile per region."""
    tp = ParallelState.build(2, 1).tp
    found = []
    for sequence_parallel in (False, True):
        with mock.patch.object(transformer, "compiled", _aot_eager):
            compiled, eager = (_layer("gpt2", tp, sequence_parallel, compile=c)
                               for c in (True, False))
        x = torch.randn(8 if sequence_parallel else 16, 2, 32, requires_grad=True)
        reasons = dynamo.explain(compiled._block)(x, None).break_reasons
        told = []
        for layer in (compiled, eager):
            with traffic.observing(traffic.CommCounter()) as counter:
                for _ in range(2):
                    layer(x).sum().backward()
            told.append(dict(counter.calls))
        found.append(({re.search(r"function `<function (\w+)", str(r.reason))[1]
                       for r in reasons}, *told))
    return found


def test_under_tp_a_layer_breaks_only_at_its_collectives():
    """Each break is a call run eagerly on purpose (``torch.compiler.disable``): the
    collectives, which dynamo could trace but then ``comm``'s observers (the flight recorder)
    would not see them run, and the TP dropout stream's switch around attention (and SP's
    dropout)."""
    for per_rank in run_distributed(_tp2, 2):
        (breaks, compiled, eager), (sp_breaks, sp_compiled, sp_eager) = per_rank
        assert breaks == sp_breaks == {"eager_apply", "_on_stream"}
        assert compiled == eager == {"all_reduce": 8}  # a pass: dense, fc2 fwd; qkv, fc1 bwd
        assert sp_compiled == sp_eager


def _compiled_run(argv: tuple[str, ...]) -> tuple:
    """The run, and how many graphs dynamo had compiled after each step."""
    graphs: list[int] = []
    count = Hooks(on_step=lambda *_: graphs.append(counters["stats"]["unique_graphs"]))
    return train(list(argv), overrides=Overrides(hooks=count)), graphs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_trains_the_eager_model(layout):
    """Within the suite's fp32 tolerance of the eager single process; the first step
    compiles, no later one does (the rampup from step 3 included). The evaluation's compiled
    graphs are compared at (1,1,1) only: cold, each costs every rank a compile."""
    flavour, extra, world = LAYOUTS[layout]
    single = world == 1
    no_eval = () if single else ("--eval-iters", "0")
    argv = _argv(flavour, *COMPILE, *extra, *no_eval)
    same = tuple(extra) if single else ()  # the flags the eager single process takes too
    per_rank = run_distributed(_compiled_run, world, argv, timeout_s=400)
    for _, graphs in per_rank:
        assert graphs[0] > 0 and graphs[1:] == graphs[:1] * 4, graphs
    if single:  # the layers share one graph (more would each count to the recompile limit)
        assert per_rank[0][1][0] == 1
    expected = reference_run(_argv(flavour, *(GQA if flavour == "llama" else ()), *same,
                                   *no_eval))
    assert_same_run(merge_ranks([r for r, _ in per_rank]), expected, FP32)


def _resume(directory: str, extra: tuple[str, ...], dropout: tuple[str, ...]) -> dict:
    """No evaluation: it would compile its own graphs, and only training is compared."""
    argv = [*train_argv("gpt2", 6, *dropout, *COMPILE, *extra, "--eval-iters", "0")]
    runs = {"continuous": train(argv),
            "stopped": train([*argv, "--save", directory, "--exit-interval", "3"]),
            "resumed": train([*argv, "--load", directory])}
    return runs


RESUMES = {  # extra flags, world size, dropout
    # hidden dropout only: the (1,1,1) layout's graph, its masks drawn in the compiled graph
    "111": ((), 1, HIDDEN_DROPOUT),
    # each rank's TP stream switched eagerly around attention and SP's dropout
    "tp2-sp": (("--tensor-model-parallel-size", "2", "--sequence-parallel"), 2, DROPOUT)}


@pytest.mark.parametrize("layout", list(RESUMES))
def test_compiled_run_with_dropout_resumes_bitwise(tmp_path, layout):
    """Under TP, merging the ranks also asks that the TP replicas stayed bitwise equal: the
    compiled regions draw the replicated activations' masks alike on every TP rank."""
    extra, world, dropout = RESUMES[layout]
    per_rank = run_distributed(_resume, world, str(tmp_path / "ckpt"), extra, dropout,
                               timeout_s=300)
    runs = {k: merge_ranks([r[k] for r in per_rank]) for k in per_rank[0]}
    assert runs["stopped"].losses == runs["continuous"].losses[:3]
    assert runs["resumed"].losses == runs["continuous"].losses[3:]
    assert runs["resumed"].grad_norms == runs["continuous"].grad_norms[3:]
    for name, value in runs["continuous"].params.items():
        assert torch.equal(runs["resumed"].params[name], value), name


def test_compiled_recompute_draws_the_same_masks():
    """Full and selective recompute re-run the compiled layer from the saved generator
    states: with dropout each trains the model the run without recompute trains (evaluation,
    which recompute does not touch, left out: its graphs would compile cold)."""
    argv = train_argv("llama", 3, *DROPOUT, *EQUIVALENCE_FLAGS, *COMPILE, "--eval-iters", "0")
    plain = train_single(argv)
    for recompute in ("full", "selective"):
        assert_same_run(train_single([*argv, "--recompute-granularity", recompute]), plain,
                        FP32)
