"""The context-parallel axis outside attention: its flags (each bad combination one line
before any process starts; the good ones, and a rampup, pass), a micro-batch's shard for a CP
rank, and a hang report's rank coordinates."""

from __future__ import annotations

import pytest
import torch

from megatron3d.cp.batch import shard_micro_batch
from megatron3d.cp.tokens import TokenInfo
from megatron3d.data.sampler import UNREAD_BATCH, MicroBatch
from megatron3d.errors import ConfigError
from megatron3d.mpu.state import AxisGroup
from megatron3d.resilience.hang_report import Analysis, coords
from megatron3d.validation import validate
from tests.test_validation import make

CP2 = {"context_parallel_size": 2, "attention_dropout": 0.0}

BAD = {  # (overrides, world size, what the one line must say)
    "world": ({**CP2, "tensor_model_parallel_size": 2}, 2, "--context-parallel-size"),
    "seq not in 2C chunks": ({**CP2, "seq_length": 30}, 2,
                             "--seq-length 30 does not divide into 2 x --context-parallel-size"),
    # 20 tokens cut into 4 chunks, but each rank's 10 do not split over TP 4
    "seq under SP": ({**CP2, "seq_length": 20, "tensor_model_parallel_size": 4,
                      "sequence_parallel": True}, 8, "--sequence-parallel"),
    "a2a heads": ({**CP2, "context_parallel_size": 4, "cp_comm_type": "a2a",
                   "num_attention_heads": 4, "tensor_model_parallel_size": 2}, 8,
                  "--cp-comm-type a2a"),
    "a2a query groups": ({**CP2, "context_parallel_size": 4, "cp_comm_type": "a2a",
                          "num_attention_heads": 8, "group_query_attention": True,
                          "num_query_groups": 2}, 4, "--num-query-groups"),
    "p2p dropout": ({"context_parallel_size": 2, "attention_dropout": 0.1}, 2,
                    "--attention-dropout"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_context_parallel_flags_are_one_line(case):
    overrides, world, text = BAD[case]
    with pytest.raises(ConfigError) as info:
        validate(make(**overrides), world)
    message = str(info.value)
    assert text in message and "\n" not in message, message


GOOD = {
    "cp2": ({**CP2}, 2),
    "cp4 x dp2": ({**CP2, "context_parallel_size": 4, "micro_batch_size": 1}, 8),
    "all_gather with dropout": ({"context_parallel_size": 2, "cp_comm_type": "all_gather"}, 2),
    "a2a gqa": ({**CP2, "cp_comm_type": "a2a", "num_attention_heads": 8,
                 "group_query_attention": True, "num_query_groups": 2}, 2),
    "cp2 x tp2 sp": ({**CP2, "tensor_model_parallel_size": 2, "sequence_parallel": True}, 4),
    "rampup": ({**CP2, "global_batch_size": 16, "rampup_batch_size": (4, 4, 100)}, 4),
}


@pytest.mark.parametrize("case", GOOD, ids=list(GOOD))
def test_good_context_parallel_flags_pass(case):
    overrides, world = GOOD[case]
    validate(make(**overrides), world)


def _batch(info: TokenInfo | None = None) -> MicroBatch:
    tokens = torch.arange(16).view(2, 8)
    return MicroBatch(tokens=tokens, labels=tokens + 100, loss_mask=(tokens % 3).float(),
                      token_info=info)


def test_a_rank_keeps_its_two_chunks_of_every_tensor():
    cp = AxisGroup(group=None, rank=1, size=2, ranks=(0, 1))
    mb = shard_micro_batch(_batch(), cp)
    index = torch.tensor([2, 3, 4, 5])  # chunks 1 and 2 of 4 chunks of 2
    assert torch.equal(mb.token_info.index, index)
    assert mb.token_info.position_ids is None and mb.token_info.doc_ids is None
    for name in ("tokens", "labels", "loss_mask"):
        assert torch.equal(getattr(mb, name), getattr(_batch(), name)[:, index]), name


def test_packed_documents_keep_their_positions_and_documents_in_the_shard():
    cp = AxisGroup(group=None, rank=0, size=2, ranks=(0, 1))
    whole = TokenInfo(index=torch.arange(8), position_ids=torch.arange(16).view(2, 8) % 5,
                      doc_ids=torch.arange(16).view(2, 8) // 5)
    mb = shard_micro_batch(_batch(whole), cp)
    index = torch.tensor([0, 1, 6, 7])
    assert torch.equal(mb.token_info.index, index)
    assert torch.equal(mb.token_info.position_ids, whole.position_ids[:, index])
    assert torch.equal(mb.token_info.doc_ids, whole.doc_ids[:, index])


def test_without_context_parallelism_a_batch_is_left_as_it_is():
    mb = _batch()
    assert shard_micro_batch(mb, AxisGroup.single()) is mb
    cp = AxisGroup(group=None, rank=0, size=2, ranks=(0, 1))
    assert shard_micro_batch(UNREAD_BATCH, cp) is UNREAD_BATCH  # a middle stage reads nothing


def test_a_hang_report_places_a_rank_on_the_context_parallel_axis():
    """Megatron's order tp, cp, dp, pp gives a rank's place, even one that wrote no dump."""
    sizes = {"tp": 2, "pp": 2, "dp": 2, "cp": 2}
    a = Analysis(world_size=16, dumps={0: {"sizes": sizes}}, missing=[])
    assert coords(a, 13) == "rank 13 (tp 1, pp 1, dp 1, cp 0)"
    assert coords(a, 6) == "rank 6 (tp 0, pp 0, dp 1, cp 1)"
