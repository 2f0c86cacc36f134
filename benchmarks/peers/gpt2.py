"""A plain GPT-2 for the PyTorch rows: readable, no parallelism inside.

The same math as megatron3d's GPT-2 flavour: learned positions, pre-LayerNorm blocks, a fused
QKV laid out per head ([heads, 3, head dim] rows, megatron3d's layout), causal SDPA, tanh
GeLU, final LayerNorm and a head tied to the word embedding. One class covers the whole model
and any pipeline stage of it: ``first`` embeds tokens, ``last`` adds the final norm and the
head, and ``layers`` names the blocks it holds by their global index (so a stage's parameter
names are the whole model's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from benchmarks.peers.config import PeerConfig


class Attention(nn.Module):
    def __init__(self, cfg: PeerConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds a slice of whole heads
        qkv = self.qkv(x).view(b, s, -1, 3, self.head_dim)  # [b, s, n, 3, d]
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # [b, n, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: PeerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.fc2 = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: PeerConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """Tokens [b, s] (``first``) or hidden states [b, s, h] in; logits [b, s, V] (``last``)
    or hidden states out."""

    def __init__(self, cfg: PeerConfig, layers: range | None = None, first: bool = True,
                 last: bool = True) -> None:
        super().__init__()
        layers = range(cfg.num_layers) if layers is None else layers
        self.first, self.last = first, last
        if first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        if last:
            self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps)
            # the tied head; on a stage without the embedding it is a copy kept in step by
            # summing both copies' gradients (as Megatron does between first and last stage)
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if first:
                self.head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (every token counts: the batches have no masking)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
