"""Scaled dot-product attention whose key/value heads each serve a group of query heads,
without copying them once per query head where a kernel can share them.

Grouped-query attention gives G key/value heads to n query heads, n/G per group. Copying the
keys and values up to n heads (``repeat_interleave``) gives back the memory and bandwidth
GQA exists to save: the kernel reads the copies, and autograd keeps them for backward. Which
way shares them depends on the kernel SDPA would run, asked with SDPA's own choice
(``torch._fused_sdp_choice``, what ``F.scaled_dot_product_attention`` itself calls):

- ``KERNEL``: a fused kernel with a grouped path (flash attention on CUDA and on the CPU,
  cuDNN) takes k, v [b, G, s, d] as they are (``enable_gqa=True``). Given unequal heads,
  SDPA's kernels without one (CUDA's memory-efficient kernel) are not chosen, and its math
  fallback copies the keys and values itself: that is why the choice is asked first.
- ``FOLD``: otherwise each group's query heads are read as one long query block, q
  [b, n, s, d] as [b, G, n/G * s, d], against k and v as they are; the ALiBi bias folds the
  same way (a view of it), the causal mask is tiled n/G times down. The scores keep their
  memory order [b, n, s, s], so the math kernel draws the same dropout mask.
- ``COPY``: causal attention that, copied, would run a fused kernel with its own causal
  masking (CUDA's memory-efficient kernel: fp32, or no flash): folding would hand it an
  explicit [n/G * s, s] mask, which it keeps for backward per layer and which stops it
  skipping the blocks above the diagonal; the copies cost less, so they stay.

Numerics against copying, measured on the CPU (``tests/model/test_grouped_attention.py``):
the output and the query gradient are bitwise the same, dropout masks included; the key and
value gradients sum a group's query heads inside the kernel instead of after it (another
order in fp32; in bf16 the CPU's flash kernel rounds its running sum more often). The CUDA
kernels' figures come from ``python -m benchmarks.grouped_attention`` on a GPU. Inside a
compiled layer (``--compile``) SDPA gets the groups as they are (``enable_gqa``): the kernel
choice is the compiler's, and asking for it here would break the graph.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend

_MATH = int(SDPBackend.MATH.value)


class Path(enum.Enum):
    KERNEL = "grouped kernel"
    FOLD = "query heads folded into rows"
    COPY = "keys and values copied per query head"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              dropout_p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias, or causal without one) v, with dropout ``dropout_p``:
    q [b, n, s, d], k and v [b, G, s, d] with G dividing n, bias [1, n, s, s] -> [b, n, s, d]."""
    if k.shape[1] == q.shape[1]:
        return _sdpa(q, k, v, bias, dropout_p)
    if torch.compiler.is_compiling():  # --compile: the compiler picks the kernel and fuses
        return _sdpa(q, k, v, bias, dropout_p, enable_gqa=True)
    path = grouped_path(q, k, v, bias, dropout_p)
    if path is Path.KERNEL:
        return _sdpa(q, k, v, bias, dropout_p, enable_gqa=True)
    if path is Path.FOLD:
        return _folded(q, k, v, bias, dropout_p)
    group_size = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group_size, dim=1) for t in (k, v))
    return _sdpa(q, k, v, bias, dropout_p)


def grouped_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                 dropout_p: float) -> Path:
    """How ``attention`` shares k and v between query heads, from the kernels SDPA would run
    for them as they are and for n heads (q's shape stands in for the copies')."""
    grouped = torch._fused_sdp_choice(q, k, v, bias, dropout_p, bias is None, enable_gqa=True)
    if grouped != _MATH:
        return Path.KERNEL
    if bias is not None:
        return Path.FOLD
    multi_head = torch._fused_sdp_choice(q, q, q, None, dropout_p, True)
    return Path.FOLD if multi_head == _MATH else Path.COPY


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
          dropout_p: float, enable_gqa: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                          is_causal=bias is None, enable_gqa=enable_gqa)


def _folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
            dropout_p: float) -> torch.Tensor:
    """Each group's query heads as one long query block against its own keys and values."""
    b, n, s, d = q.shape
    groups = k.shape[1]
    rows = n // groups * s
    if bias is None:  # head after head: query t of each sees keys 0..t
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril().repeat(n // groups, 1)
    else:
        mask = bias.reshape(bias.shape[0], groups, rows, s)
    out = F.scaled_dot_product_attention(q.reshape(b, groups, rows, d), k, v, attn_mask=mask,
                                         dropout_p=dropout_p)
    return out.view(b, n, s, d)
