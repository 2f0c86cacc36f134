"""Megatron-Core's side of a row: GPTModel chunks with megatron3d's weights, its DDP and
(distributed) optimizer, built the way Megatron-LM's ``pretrain_gpt.py`` builds them.

Import only after ``mcore_cpu.apply()``: megatron.core reads the patched CUDA calls.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F  # noqa: N812
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig

from benchmarks.peers.config import PeerConfig, Row
from benchmarks.peers.names import MCORE_HEAD, mcore_name, megatron3d_name_of_mcore

Weights = dict[str, torch.Tensor]


def transformer_config(cfg: PeerConfig, row: Row) -> TransformerConfig:
    """fp32, no dropout, no fused kernels (none exist on CPU), tanh GeLU as megatron3d."""
    virtual = int(row.option("virtual", "0")) or None
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads, ffn_hidden_size=cfg.ffn_size,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=cfg.layernorm_eps,
        # initialised, then overwritten: initialisation is what marks TP-split parameters
        init_method_std=cfg.init_std, use_cpu_initialization=True,
        perform_initialization=True, tensor_model_parallel_size=row.tp,
        pipeline_model_parallel_size=row.pp, virtual_pipeline_model_parallel_size=virtual,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        activation_func=functools.partial(F.gelu, approximate="tanh"),
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, attention_softmax_in_fp32=True,
        # gloo matches sends to receives between two ranks in the order they are posted;
        # the batched p2p posts a gradient before an activation that the peer receives in
        # the other order (NCCL's grouped calls hide it). At PP = 2 with interleaving both
        # go to the same rank, so they must be posted one by one, in Megatron's even/odd
        # order.
        batch_p2p_comm=False)


def build_chunks(cfg: PeerConfig, row: Row, config: TransformerConfig,
                 weights: Weights) -> list[GPTModel]:
    """This rank's model chunks (one, or v under the interleaved schedule), loaded."""
    virtual = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp in range(virtual or 1):
        stage = vp if virtual else None
        model = GPTModel(
            config, get_gpt_layer_local_spec(), cfg.vocab_size, cfg.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute", vp_stage=stage)
        load(model, weights)
        chunks.append(model)
    return chunks


def _layer_offset(model: GPTModel) -> int:
    """The global index of the chunk's first layer (GPTModel numbers them from 1)."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def _tp_slice(logical: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """This TP rank's part of a logical tensor, along the dim GPTModel splits it on."""
    if not getattr(param, "tensor_model_parallel", False):
        return logical
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return logical.chunk(tp, dim=param.partition_dim)[rank]


def load(model: GPTModel, weights: Weights) -> None:
    """Export megatron3d's weights into the chunk's parameters by name, then import them
    back and check both directions agree (every parameter filled, every value equal)."""
    offset = _layer_offset(model)
    params = dict(model.named_parameters())
    filled = set()
    for name, logical in weights.items():
        try:
            target = mcore_name(name, offset)
        except KeyError:
            continue
        if target in params:
            params[target].data.copy_(_tp_slice(logical, params[target]))
            filled.add(target)
    if MCORE_HEAD in params and MCORE_HEAD not in filled:  # the tied copy on the last stage
        head = params[MCORE_HEAD]
        head.data.copy_(_tp_slice(weights["embedding.word_embeddings.weight"], head))
        filled.add(MCORE_HEAD)
    if filled != params.keys():
        raise KeyError(f"no megatron3d weight for {sorted(params.keys() - filled)}")
    for name, param in params.items():  # and back: the import direction
        back = weights[megatron3d_name_of_mcore(name, offset)]
        if not torch.equal(_tp_slice(back, param), param.data):
            raise ValueError(f"{name} does not map back onto its megatron3d weight")


def wrap(config: TransformerConfig, chunks: list[GPTModel],
         distributed_optimizer: bool) -> list[DistributedDataParallel]:
    """Megatron-Core's DDP over each chunk as Megatron-LM runs it with
    ``--overlap-grad-reduce`` (megatron3d always overlaps): gradients in fp32 buckets whose
    reduction (a reduce-scatter for the distributed optimizer) starts in backward of the
    last micro-batch; the schedules hold it back on the others through ``no_sync_func``
    and start each chunk's as soon as its backward is done through ``grad_sync_func``."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True,
        use_distributed_optimizer=distributed_optimizer)
    models = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads  # DP reduce, tied embedding sum
    no_sync = [m.no_sync for m in models]
    start_sync = [m.start_grad_sync for m in models]
    config.no_sync_func = no_sync if len(models) > 1 else no_sync[0]
    config.grad_sync_func = start_sync if len(models) > 1 else start_sync[0]
    return models


def optimizer(cfg: PeerConfig, models: list[DistributedDataParallel],
              distributed_optimizer: bool) -> MegatronOptimizer:
    """Adam with decoupled weight decay (AdamW), no decay on biases and norms (Megatron's
    default rule, megatron3d's too), gradients clipped at ``clip_grad``."""
    opt_config = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.beta1, adam_beta2=cfg.beta2, adam_eps=cfg.eps, clip_grad=cfg.clip_grad,
        use_distributed_optimizer=distributed_optimizer, params_dtype=torch.float32)
    return get_megatron_optimizer(opt_config, models)
