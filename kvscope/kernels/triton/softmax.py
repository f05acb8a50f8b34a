"""The online-softmax step shared by the decode and prefill kernels (flash-attention style)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, k, v, visible, m, l, acc, sm_scale_log2, IEEE: tl.constexpr):
    """Fold one K/V tile into the running (max, sum, output) of a query tile.

    q [M, D], k/v [N, D], visible [M, N] (or broadcastable); scores are in log2 units.
    """
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(visible, scores * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc
