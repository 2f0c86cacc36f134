"""The plain PyTorch baseline: transformers' GPT-2 (SDPA attention) with megatron3d's
weights, a bf16-autocast training loop over the same batches, torch's fused AdamW and the
same clipping, learning rate and weight decay; optionally under ``torch.compile``.

Compiled regionally (each transformer block, one compilation serving all of them: the recipe
torch documents for models of repeated blocks), so that compiling takes seconds, not minutes,
inside the check's budget; the embedding, final norm and head run eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from megatron3d import device as devices
from megatron3d.config import ModelConfig
from megatron3d.convert.hf import mapping, tensor_map


@dataclass(frozen=True)
class Optim:
    """The optimizer settings megatron3d's run was given (``speed.argv``)."""

    lr: float
    weight_decay: float
    clip_grad: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True)
class Timed:
    """Seconds per step after the warm-up steps, every step's loss, the warm-up's seconds."""

    step_s: float
    losses: list[float]
    warmup_s: float


def gpt2(model: ModelConfig, weights: dict[str, torch.Tensor], dev: torch.device,
         compile_backend: str | None) -> torch.nn.Module:
    """transformers' GPT2LMHeadModel holding ``weights`` (megatron3d's logical tensors), fp32
    on ``dev``, its blocks compiled with ``compile_backend`` (None: eager)."""
    import transformers

    config = mapping.hf_config(model)
    config_class = transformers.CONFIG_MAPPING[config["model_type"]]
    with torch.device(dev):  # drawn where it runs: seconds, not a CPU init of 1.3B weights
        hf = transformers.AutoModelForCausalLM.from_config(config_class(**config),
                                                           attn_implementation="sdpa")
    state = {k: v for name, t in weights.items() for k, v in tensor_map.to_hf(model, name, t)}
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in state.items()},
                                             strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not fit GPT-2: missing {missing}, unexpected "
                           f"{unexpected}")
    hf.tie_weights()
    hf.to(dev)  # in case from_config placed it elsewhere
    if compile_backend is not None:
        for block in hf.transformer.h:
            block.compile(backend=compile_backend)
    return hf.train()


def train(hf: torch.nn.Module, batches: Sequence[torch.Tensor], micro_batch: int,
          warmup: int, optim: Optim, dev: torch.device) -> Timed:
    """Train on ``batches`` (each a step's [G, s + 1] token ids); the steps after ``warmup``
    are timed, the device synchronised at both ends only."""
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=optim.lr,
                            betas=optim.betas, eps=optim.eps, fused=True)
    losses: list[torch.Tensor] = []
    started = time.perf_counter()
    start = started
    for step, tokens in enumerate(batches):
        if step == warmup:
            devices.synchronize(dev)
            start = time.perf_counter()
        micro = tokens.to(dev).split(micro_batch)
        total = torch.zeros((), device=dev)
        for chunk in micro:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = hf(input_ids=chunk[:, :-1]).logits  # [b, s, V]
            loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
            (loss / len(micro)).backward()
            total += loss.detach() / len(micro)
        torch.nn.utils.clip_grad_norm_(hf.parameters(), optim.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    devices.synchronize(dev)
    end = time.perf_counter()
    timed = len(batches) - warmup
    return Timed((end - start) / timed, [x.item() for x in losses], start - started)
