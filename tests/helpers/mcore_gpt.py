"""Megatron-Core's own GPTModel on CPU/gloo: it saves a ``torch_dist`` checkpoint the way
Megatron-LM does and computes its loss on a batch, for the import test to compare with.

Needs megatron-core (0.16.1 in the peer set, not the project venv); only the test that uses
it imports this module, and only inside the worker processes. Megatron-Core asks CUDA for a
device in three places that matter on CPU; ``_cpu_only`` redirects them, each said why.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

FLAVOURS = {  # Megatron-LM arguments (the names its parse_args gives) of two small models
    "gpt2": {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
             "swiglu": False, "openai_gelu": True, "add_bias_linear": True,
             "untie_embeddings_and_output_weights": False, "group_query_attention": False,
             "num_query_groups": None, "num_attention_heads": 4, "ffn_hidden_size": 128},
    "llama": {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
              "openai_gelu": False, "add_bias_linear": False,
              "untie_embeddings_and_output_weights": True, "group_query_attention": True,
              "num_query_groups": 2, "num_attention_heads": 8, "ffn_hidden_size": 64},
}


def _cpu_only() -> None:
    """GPTModel builds on CPU (``use_cpu_initialization``) except that it places rotary
    frequencies and buffers on ``torch.cuda.current_device()``, moves the tied embedding
    with ``.cuda()`` and saving synchronises the device before copying tensors out: on a
    CPU-only process the device is the CPU, the move and the wait are no-ops. Attention
    forks CUDA's RNG around dropout (0 here): a plain context does."""
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    torch.cuda.synchronize = lambda *args, **kwargs: None
    mcore_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def megatron_args(flavour: str, tp: int, pp: int, vocab: int, seq: int) -> argparse.Namespace:
    """What Megatron-LM's ``args`` hold for this model (a subset, its own names); an enum
    member among them, as Megatron-LM's ``attention_backend`` is."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=4, hidden_size=32, kv_channels=None, seq_length=seq,
        max_position_embeddings=seq, padded_vocab_size=vocab, norm_epsilon=1e-5,
        rotary_base=10000, rotary_percent=1.0, bias_gelu_fusion=False, init_method_std=0.5,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        attention_backend=AttnBackend.local, ckpt_format="torch_dist", **FLAVOURS[flavour])


def _model(args: argparse.Namespace):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, add_bias_linear=args.add_bias_linear,
        gated_linear_unit=args.swiglu, hidden_dropout=0.0, attention_dropout=0.0,
        activation_func=F.silu if args.swiglu else functools.partial(F.gelu,
                                                                     approximate="tanh"),
        init_method_std=args.init_method_std, use_cpu_initialization=True,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    return GPTModel(
        config, get_gpt_layer_local_spec(normalization=args.normalization),
        args.padded_vocab_size, args.seq_length, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type)


def save_and_loss(root: str, flavour: str, tp: int, pp: int, vocab: int,
                  batch: torch.Tensor) -> float | None:
    """On every rank of a TP x PP world: build the model from seed 0, save it as Megatron-LM
    saves iteration 1 under ``root``, and return the mean token loss of ``batch`` ([b, s+1]
    token ids) on the last stage (None on the others)."""
    _cpu_only()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tp, pp)
    torch.manual_seed(0)
    args = megatron_args(flavour, tp, pp, vocab, batch.shape[1] - 1)
    model = _model(args).eval()
    iteration = Path(root) / "iter_0000001"
    if dist.get_rank() == 0:
        iteration.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args,
                             "checkpoint_version": 3.0, "iteration": 1}, str(iteration))
    if dist.get_rank() == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text("1")
    loss = _forward(model, batch)
    ps.destroy_model_parallel()
    return loss


def _forward(model, batch: torch.Tensor) -> float | None:
    """Stage by stage: each stage's output goes to the next stage's rank of the same TP
    rank (a point-to-point send, which gloo runs on CPU)."""
    from megatron.core import parallel_state as ps

    tokens, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    future = torch.ones(tokens.shape[1], tokens.shape[1]).triu(1).bool()[None, None]  # masked
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], model.config.hidden_size)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, future, labels=labels if model.post_process else None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
    return out.float().mean().item()
