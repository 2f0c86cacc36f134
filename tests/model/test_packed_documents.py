"""Packed documents through the model: a sample of several documents with both reset flags
gives each token the logits of its document run alone (an oracle that shares no code with
the mask: nothing but a shorter sequence), for learned positions, ALiBi and RoPE with GQA;
with positions reset but one attention span, the causal kernel gives what the explicit mask
gives."""

from __future__ import annotations

import pytest
import torch

from megatron3d.cp import attention as cp_attention
from megatron3d.cp.tokens import TokenInfo
from megatron3d.data.documents import Documents
from megatron3d.model.gpt import build_gpt
from tests.helpers.tiny import layer_context, model_config
from tests.helpers.tolerances import FP32

EOD = 202  # the tiny models' last id
FLAVOURS = {
    "gpt2": {},
    "bloom": {},
    "llama": {"group_query_attention": True, "num_query_groups": 2},
}


def _model(flavour: str) -> torch.nn.Module:
    cfg = model_config(flavour, **FLAVOURS[flavour])
    return build_gpt(layer_context(cfg)).eval()


def _document(length: int, gen: torch.Generator) -> list[int]:
    """``length`` tokens, the last one the EOD that ends it."""
    return torch.randint(0, EOD, (length - 1,), generator=gen).tolist() + [EOD]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_each_document_gets_the_logits_it_has_alone(flavour):
    model = _model(flavour)
    gen = torch.Generator().manual_seed(0)
    samples = [[_document(7, gen), _document(9, gen)],  # the last one cut by the window
               [_document(1, gen), _document(3, gen), _document(4, gen), _document(8, gen)]]
    tokens = torch.tensor([sum(docs, []) for docs in samples])  # [2, 16]
    rule = Documents(EOD, reset_position_ids=True, reset_attention_mask=True)
    with torch.no_grad():
        packed = model(tokens, rule.token_info(tokens))  # [s, b, v]
        for b, docs in enumerate(samples):
            start = 0
            for doc in docs:
                alone = model(torch.tensor([doc]))[:, 0]  # [len, v]: a plain sequence
                torch.testing.assert_close(packed[start:start + len(doc), b], alone, **FP32)
                start += len(doc)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_reset_positions_alone_take_the_causal_kernel(flavour, monkeypatch):
    """Positions restart, attention still spans the sample: the kernel's own causal mask,
    equal to the explicit mask of one document per sample (ALiBi reads the distance in the
    sequence, as Megatron-DeepSpeed's BLOOM does: positions restarting would otherwise give
    an earlier document's keys a bonus)."""
    model = _model(flavour)
    tokens = torch.randint(0, EOD, (2, 16), generator=torch.Generator().manual_seed(1))
    tokens[0, [3, 4, 10]] = EOD
    tokens[1, 0] = EOD
    info = Documents(EOD, reset_position_ids=True).token_info(tokens)
    one_document = TokenInfo(info.index, info.position_ids, torch.zeros_like(tokens))
    calls = []
    reference = cp_attention.context_attention

    def counting(*args, **kwargs):
        calls.append(args[3])
        return reference(*args, **kwargs)

    monkeypatch.setattr("megatron3d.model.attention.context_attention", counting)
    with torch.no_grad():
        fast = model(tokens, info)
        assert calls == []
        explicit = model(tokens, one_document)
    assert len(calls) == 2  # one per layer
    torch.testing.assert_close(fast, explicit, **FP32)
