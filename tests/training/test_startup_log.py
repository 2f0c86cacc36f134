"""The start-up log says how big the model is: the padded vocabulary, and the total of unique
parameters (a tied embedding once, all stages together), equal to the model's own count."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

from megatron3d import device as devices
from megatron3d.accounting.model_size import model_size
from megatron3d.model.gpt import build_gpt
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup
from tests.helpers.dist import run_distributed
from tests.helpers.log_lines import LogLines
from tests.helpers.runs import build
from tests.helpers.tiny import layer_context, model_config, train_argv

TOTAL = re.compile(r"model: ([\d,]+) parameters on this rank, ([\d,]+) unique parameters in "
                   r"total")
TABLE_TOTAL = re.compile(r"^total +([\d,]+) +unique parameters$", re.MULTILINE)


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _build_and_count(flavour: str, *flags: str) -> tuple[str, int]:
    """On every rank: the build's log, and the parameters this rank owns (a tied copy is
    owned by the first stage, a TP-replicated one by TP rank 0)."""
    collect = LogLines()
    log = logging.getLogger("megatron3d.training.build")
    log.addHandler(collect)
    log.setLevel(logging.INFO)
    try:
        trainer, state = build(train_argv(flavour, 4, *flags))
    finally:
        log.removeHandler(collect)
    owned = sum(p.numel() for p in trainer.model.engine.stage.parameters()
                if (state.is_first_stage or get_meta(p).tied_key is None)
                and (state.tp.rank == 0 or get_meta(p).tp_split_dim is not None))
    return "\n".join(collect.lines), owned


def _single_process_count(flavour: str, **model: object) -> int:
    """What the whole model holds in one process: ``parameters()`` yields a tied weight once."""
    ctx = layer_context(model_config(flavour, **model))
    return sum(p.numel() for p in build_gpt(ctx).parameters())


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])  # tied and untied embeddings
def test_pp1_logs_padded_vocab_and_unique_parameters(flavour):
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        log, owned = _build_and_count(flavour)
    finally:
        torch.distributed.destroy_process_group()
    assert " > padded vocab (size: 203) with 5 dummy tokens (new size: 208)" in log
    per_rank, total = (_number(x) for x in TOTAL.search(log).groups())
    assert total == per_rank == owned == _single_process_count(flavour)
    assert _number(TABLE_TOTAL.search(log)[1]) == total
    stage = re.search(r"^ +0 +([\d,]+) +embedding, transformer layers 1-2, final norm, "
                      r"output layer$", log, re.MULTILINE)
    assert _number(stage[1]) == total


def test_pp2_counts_the_tied_embedding_once():
    results = run_distributed(_build_and_count, 2, "gpt2", "--pipeline-model-parallel-size", "2")
    log = results[-1][0]  # every rank logs here; pretrain_gpt shows the last rank's
    total = _number(TOTAL.search(log)[2])
    assert total == sum(owned for _, owned in results) == _single_process_count("gpt2")
    first, last = (_number(x) for x in re.findall(r"^ +[01] +([\d,]+) ", log, re.MULTILINE))
    assert first + last == total == _number(TABLE_TOTAL.search(log)[1])
    embedding = 208 * 32
    assert re.search(rf"^ +1 +[\d,]+ +transformer layer 2, final norm, output layer "
                     rf"\(\+ {embedding:,} tied copy of embedding\)$", log, re.MULTILINE), log


def test_tp2_counts_slices_together_and_replicas_once():
    """Llama-style (untied, SwiGLU's stacked slices); TP 2 pads the vocabulary to 224."""
    results = run_distributed(_build_and_count, 2, "llama", "--tensor-model-parallel-size", "2",
                              "--make-vocab-size-divisible-by", "56")
    log = results[-1][0]
    assert " > padded vocab (size: 203) with 21 dummy tokens (new size: 224)" in log
    per_rank, total = (_number(x) for x in TOTAL.search(log).groups())
    assert total == sum(owned for _, owned in results)
    single = _single_process_count("llama", make_vocab_size_divisible_by=112)
    assert total == single == _number(TABLE_TOTAL.search(log)[1])
    assert per_rank < total


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("flavour", "model"), [
    ("gpt2", {}), ("bloom", {}),
    ("llama", {"group_query_attention": True, "num_query_groups": 2})])
def test_model_size_matches_the_single_process_model(flavour, model, tp):
    """Counted on the meta device at TP ``tp`` (sequence-parallel too): the whole model with
    the vocabulary padding that TP size allocates."""
    ctx = dataclasses.replace(layer_context(model_config(flavour, **model)),
                              tp=AxisGroup(None, 0, tp, tuple(range(tp))),
                              sequence_parallel=tp > 1)
    assert model_size(ctx).unique == _single_process_count(
        flavour, **model, make_vocab_size_divisible_by=8 * tp)
