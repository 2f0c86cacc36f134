"""Packed documents through the model: a sample of several documents with both reset flags
gives each token the logits of its document run alone (an oracle that shares no code with
the mask: nothing but a shorter sequence), for learned positions, ALiBi and RoPE with GQA;
with positions reset but one attention span, the causal kernel gives what the explicit mask
gives."""

from __future__ import annotations

import pytest
import torch

from megatron3d.cp import attention as cp_attention
from megatron3d.cp.attention import context_attention
from megatron3d.cp.layout import rank_index, shard
from megatron3d.cp.tokens import TokenInfo
from megatron3d.data.documents import Documents
from megatron3d.data.sampler import micro_batches
from megatron3d.model.gpt import build_gpt, lm_loss
from megatron3d.model.positional import alibi_slopes
from megatron3d.mpu.state import ParallelState
from tests.helpers.dist import run_distributed
from tests.helpers.host_sync import no_host_sync
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


@pytest.mark.parametrize("case", ["gpt2", "llama, 8 heads in 2 groups"])
def test_restarted_positions_equal_transformers_given_the_same_position_ids(case):
    """RoPE is blind to a shift of a whole document, so the oracle above cannot see it read
    the restarted positions: transformers, handed the same position ids, can."""
    from tests.model import test_against_transformers as hf

    cfg, ours = hf._ours(hf.CASES[case])
    theirs = hf._theirs(cfg, hf._logical(ours))
    tokens = torch.randint(0, EOD, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(2))
    tokens[0, [5, 6, 15]] = EOD
    tokens[1, 11] = EOD
    info = Documents(EOD, reset_position_ids=True).token_info(tokens)
    with torch.no_grad():
        expected = theirs(tokens, position_ids=info.position_ids).logits
        actual = ours(tokens, info).transpose(0, 1)[..., : cfg.vocab_size]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_eod_mask_loss_is_the_mean_over_the_other_tokens():
    """With --eod-mask-loss the micro-batch's loss is the cross entropy averaged over the
    tokens whose input is not an EOD, whatever the documents around them."""
    cfg = model_config("llama")
    ctx = layer_context(cfg)
    model = build_gpt(ctx).eval()
    sample = torch.randint(0, EOD, (2, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(3))
    sample[0, [2, 3, 9]] = EOD
    sample[1, [0, 16]] = EOD
    tokens, labels = sample[:, :-1], sample[:, 1:]
    rule = Documents(EOD, mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    with torch.no_grad():
        logits = model(tokens, rule.token_info(tokens))  # [s, b, v]
        loss = lm_loss(logits, labels, rule.loss_mask(tokens), ctx)
    per_token = torch.nn.functional.cross_entropy(
        logits[..., : cfg.vocab_size].transpose(0, 1).reshape(-1, cfg.vocab_size),
        labels.reshape(-1), reduction="none")
    kept = (tokens != EOD).reshape(-1)
    assert kept.sum() == 2 * cfg.seq_length - 4
    torch.testing.assert_close(loss, per_token[kept].mean(), **FP32)


def _split_attention(seq: int) -> list[list[torch.Tensor]]:
    """One rank of two splitting a packed sequence (chunks r and 3 - r): its queries' output
    and its shard's q, k, v gradients from ``context_attention``, without and with ALiBi."""
    state = ParallelState.build(1, 1, cp_size=2)
    q, k, v, positions, documents, weight = _attention_inputs(seq)
    rank = state.cp.rank
    info = TokenInfo(rank_index(seq, 2, rank), shard(positions, 1, 2, rank),
                     shard(documents, 1, 2, rank))
    results = []
    for slopes in (None, alibi_slopes(q.shape[1])):
        local = [shard(t, 2, 2, rank).requires_grad_() for t in (q, k, v)]
        out = context_attention(*local, info, state.cp, slopes)
        (out * shard(weight, 2, 2, rank)).sum().backward()
        results.append([out.detach(), *(t.grad for t in local)])
    return results


def _attention_inputs(seq: int) -> tuple[torch.Tensor, ...]:
    """q [2, 4, s, 8], k and v with 2 groups, positions and documents of Megatron's rule
    (documents crossing chunk boundaries), and a weight for the output's gradient."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, heads, seq, 8, generator=gen) for heads in (4, 2, 2))
    tokens = torch.randint(0, EOD, (2, seq), generator=gen)
    tokens[0, [2, 5, 6, 13]] = EOD  # chunks of 4: ends inside chunks 0, 1 and 3
    tokens[1, [9]] = EOD  # one document over chunks 0-2, another over 2-3
    info = Documents(EOD, reset_position_ids=True, reset_attention_mask=True).token_info(tokens)
    weight = torch.randn(2, 4, seq, 8, generator=gen)
    return q, k, v, info.position_ids, info.doc_ids, weight


def _whole_sequence_sdpa(seq: int, alibi: bool) -> list[torch.Tensor]:
    """torch SDPA over the whole sequence in one process, the per-document causal mask (and
    ALiBi's slope times the distance) written out here: output and q, k, v gradients."""
    q, k, v, _, documents, weight = _attention_inputs(seq)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    i = torch.arange(seq)
    allowed = (i[None, :] <= i[:, None]) & (documents[:, None, :, None]
                                            == documents[:, None, None, :])  # [b, 1, s, s]
    mask = torch.where(allowed, 0.0, float("-inf"))
    if alibi:
        mask = mask + alibi_slopes(4).view(1, 4, 1, 1) * (i[None, :] - i[:, None]).float()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    (expected * weight).sum().backward()
    return [expected.detach(), q.grad, k.grad, v.grad]


def test_documents_across_context_parallel_chunks_equal_sdpa_with_their_mask():
    """CP=2 (2 spawned ranks): each rank's output and q, k, v gradients equal torch SDPA's
    over the whole sequence given the per-document mask, with and without ALiBi."""
    seq = 16
    per_rank = run_distributed(_split_attention, 2, seq)
    for alibi in (False, True):
        reference = _whole_sequence_sdpa(seq, alibi)
        for rank, results in enumerate(per_rank):
            for name, got, want in zip(["out", "q", "k", "v"], results[alibi], reference,
                                       strict=True):
                torch.testing.assert_close(
                    got, shard(want, 2, 2, rank), **FP32,
                    msg=lambda m, n=name, r=rank, a=alibi: f"rank {r} {n} alibi={a}: {m}")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_packed_micro_batches_train_without_a_host_sync(flavour):
    """The documents are found, and the model runs forward and backward over them, with
    every device -> host transfer patched to raise (the hot-path rule)."""
    cfg = model_config(flavour, **FLAVOURS[flavour])
    ctx = layer_context(cfg)
    model = build_gpt(ctx)
    sample = torch.randint(0, EOD + 1, (4, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(5))

    class Samples:
        def samples(self, start: int, count: int) -> torch.Tensor:
            return sample[start:start + count]

    rule = Documents(EOD, mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    with no_host_sync():
        for mb in micro_batches(Samples(), 0, 4, 2, 0, 1, torch.device("cpu"), rule):
            lm_loss(model(mb.tokens, mb.token_info), mb.labels, mb.loss_mask, ctx).backward()
