"""The model itself against an independent implementation: Hugging Face transformers.

Every other model test compares layouts of our own model with each other, which cannot see
a bug all layouts share (a non-causal mask, a wrong ALiBi slope, a rotary convention). Here
each flavour, with every parameter drawn at random (norm weights and biases included, so a
misplaced one shows), must give the logits of the matching transformers class within 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron3d.cli.arguments import parse_args
from megatron3d.config import ModelConfig
from megatron3d.convert.hf import mapping, tensor_map
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt
from megatron3d.model.positional import rotary_frequencies
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup
from tests.helpers.device import rank_device
from tests.helpers.tiny import train_argv

transformers = pytest.importorskip("transformers")

GQA = ("--group-query-attention", "--num-query-groups")
LLAMA3 = ("--use-rope-scaling",)
CASES = {
    "gpt2": ("gpt2",),
    "bloom, 6 heads (non-power-of-two ALiBi slopes)": ("bloom", "--hidden-size", "48",
                                                       "--num-attention-heads", "6"),
    "llama": ("llama",),
    "llama, 8 heads in 2 groups": ("llama", "--num-attention-heads", "8", *GQA, "2"),
    "llama, 8 heads in 4 groups": ("llama", "--num-attention-heads", "8", *GQA, "4"),
    "llama, 1 group": ("llama", *GQA, "1"),
    "llama, tied head, rotary base 5e5": ("llama-tied", "--rotary-base", "500000",
                                          "--layernorm-epsilon", "1e-6"),
    # head dim 8: wavelengths 6.3, 63, 628 and 6283 against 16 and 64 (a context of 64 over
    # the high and low frequency factors): one frequency kept, one smoothed, two divided
    "llama 3.x, rope scaling": ("llama", *GQA, "2", *LLAMA3, "--rope-scaling-factor", "4",
                                "--rope-scaling-original-max-position-embeddings", "64"),
    "qwen2: qkv bias, tied head": ("llama-tied", "--num-attention-heads", "8", *GQA, "2",
                                   "--add-qkv-bias"),
}


def _ours(case: tuple[str, ...], device: torch.device | None = None,
          dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, torch.nn.Module]:
    flavour, *extra = case
    argv = train_argv(flavour.removesuffix("-tied"), 1, "--seq-length", "24", "--vocab-size",
                      "203", *extra)
    if flavour.endswith("-tied"):
        argv.remove("--untie-embeddings-and-output-weights")
    cfg = parse_args(argv).model
    model = build_gpt(LayerContext(cfg, AxisGroup.single(), 1234, dtype, device)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return cfg, model


def _logical(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for p in model.parameters():
        meta = get_meta(p)
        out[meta.name] = (p.detach()[: meta.logical_rows] if meta.logical_rows
                          else p.detach()).float()
    return out


def _theirs(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    config = mapping.hf_config(cfg)
    config_class = transformers.CONFIG_MAPPING[config["model_type"]]
    model = transformers.AutoModelForCausalLM.from_config(
        config_class(**config), attn_implementation="eager").eval()
    state = dict(pair for name, t in tensors.items() for pair in tensor_map.to_hf(cfg, name, t))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_embeddings:
        model.tie_weights()
    return model


def _logits(cfg: ModelConfig, ours: torch.nn.Module, theirs: torch.nn.Module,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, theirs) logits [b, s, V] of one batch of random tokens, in fp32."""
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = theirs(tokens).logits  # [b, s, V]
        actual = ours(tokens).transpose(0, 1)[..., : cfg.vocab_size]  # [s, b, Vpad] -> [b, s, V]
    return actual.float(), expected.float()


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_logits_equal_transformers(case):
    device = rank_device()
    cfg, ours = _ours(case, device)
    theirs = _theirs(cfg, _logical(ours)).to(device)
    actual, expected = _logits(cfg, ours, theirs, device)
    assert expected.abs().max() > 1.0  # random weights give logits well away from zero
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("case", [CASES["gpt2"], CASES["llama, 8 heads in 2 groups"]],
                         ids=["gpt2", "llama-gqa"])
def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(case):
    """In bf16 neither model gives the fp32 logits; ours (built in bf16, as --bf16 builds it)
    must be no further from them than transformers' model cast to bf16 is, within 2x."""
    device = rank_device()
    cfg, ours = _ours(case, device)
    weights = _logical(ours)
    reference, _ = _logits(cfg, ours, _theirs(cfg, weights).to(device), device)
    _, ours_bf16 = _ours(case, device, torch.bfloat16)
    with torch.no_grad():
        for p, q in zip(ours_bf16.parameters(), ours.parameters(), strict=True):
            p.copy_(q)
    theirs_bf16 = _theirs(cfg, weights).to(device, torch.bfloat16)
    actual, expected = _logits(cfg, ours_bf16, theirs_bf16, device)
    ours_error = (actual - reference).abs().max().item()
    their_error = (expected - reference).abs().max().item()
    assert 0 < their_error < 0.1 * reference.abs().max().item()  # bf16 indeed, and sane
    assert ours_error <= 2 * their_error, (ours_error, their_error)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_tensors_round_trip_through_the_transformers_layout_bitwise(case):
    cfg, ours = _ours(case)
    tensors = _logical(ours)
    theirs = dict(pair for name, t in tensors.items() for pair in tensor_map.to_hf(cfg, name, t))
    back = dict(tensor_map.from_hf(cfg, list(tensors), theirs.__getitem__))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name


_SAME = ("num_layers", "hidden_size", "num_attention_heads", "query_groups", "ffn_size",
         "seq_length", "vocab_size", "position_embedding_type", "normalization", "swiglu",
         "add_bias", "add_qkv_bias", "embed_layernorm", "tie_embeddings", "layernorm_epsilon",
         "rotary_base", "use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
         "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings")


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_config_round_trips(case):
    cfg, _ = _ours(case)
    rebuilt = ModelConfig(**mapping.model_fields(mapping.hf_config(cfg), cfg.seq_length))
    assert {k: getattr(rebuilt, k) for k in _SAME} == {k: getattr(cfg, k) for k in _SAME}
    assert mapping.hf_config(rebuilt) == mapping.hf_config(cfg)


def test_llama3_frequencies_are_transformers_bitwise():
    """Llama 3.1's and 3.2's RoPE scaling at their real sizes (head dim 128, base 5e5,
    factors 8 and 32 over a context of 8192): the same inverse frequencies as transformers'
    own ``llama3`` rope type, bit for bit, and different from the unscaled ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for factor in (8.0, 32.0):
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
        config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32,
                                          rope_parameters=rope)
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
        ours = ModelConfig(num_layers=1, hidden_size=4096, num_attention_heads=32,
                           seq_length=16, vocab_size=8, position_embedding_type="rope",
                           rotary_base=500000.0, use_rope_scaling=True,
                           rope_scaling_factor=factor)
        actual = rotary_frequencies(ours)
        assert torch.equal(actual, expected), factor
        plain = rotary_frequencies(dataclasses.replace(ours, use_rope_scaling=False))
        assert (actual != plain).sum() > 16 and (actual == plain).sum() > 16
