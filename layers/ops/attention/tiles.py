"""Attention tiles: the kernels ring attention runs per (query block, key block) pair.

A tile kernel has two calls::

    forward(q, k, v, scale, causal, mask) -> (out fp32 [b, Hq, n, dv], lse fp32 [b, Hq, n])
    backward(do, q, k, v, out, lse, scale, causal, mask) -> (dq [b, Hq, n, d], dk, dv) fp32

q [b, Hq, n, d], k [b, Hk, m, d], v [b, Hk, m, dv] (GQA: Hq a multiple of Hk, never expanded
on CPU); ``causal``: a square diagonal tile (query i sees keys 0..i); ``mask`` (bool
[1|b, 1, n, m], True = may attend) or None (every key). In the backward ``out`` and ``lse`` are
the *whole row's* final output and log-sum-exp, not the tile's: then exp(scores - lse) are the
true probabilities and the tiles' gradients simply add up (what flash attention's backward does
per block, and what Megatron's ring does with TE's kernels).

``MathTiles`` is the reference (fp32 scores, any mask; the ``local`` backend's). The fused
tiles run torch's kernels, which never hold a tile's scores: ``CpuFlashTiles``
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, GQA native) and
``CudaFlashTiles`` (the flash kernel for fp16/bf16, K/V expanded per query head); the cpu and
cuda backends pick one by the tensors' device. Tiles a fused kernel cannot take (a mask, a
value width other than the key width, fp32 on CUDA) go to the math reference, which the ring
keeps to ``TILE`` x ``TILE`` tokens.
"""
from __future__ import annotations

import torch


def _grouped(q, hk: int):
    """[b, Hq, n, ...] -> [b, Hk, rep, n, ...] (a view)."""
    return q.unflatten(1, (hk, -1))


def _math_mask(causal: bool, mask, n: int, m: int, device):
    """The tile's mask over grouped scores [b, Hk, rep, n, m], or None."""
    if causal:
        return torch.ones(n, m, dtype=torch.bool, device=device).tril()
    return None if mask is None else mask.unsqueeze(2)  # [1|b, 1, 1, n, m]


class MathTiles:
    """The reference tile kernel: fp32 einsum scores, any mask (shapes in the module docstring)."""

    name = "math"

    def scores(self, q, k, scale, causal, mask):
        """-> fp32 masked scores [b, Hk, rep, n, m]."""
        s = torch.einsum("bgrnd,bgmd->bgrnm", _grouped(q, k.size(1)).float(), k.float()) * scale
        allowed = _math_mask(causal, mask, q.size(2), k.size(2), q.device)
        return s if allowed is None else s.masked_fill(~allowed, float("-inf"))

    def forward(self, q, k, v, scale, causal=False, mask=None):
        s = self.scores(q, k, scale, causal, mask)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), 0.0, m)  # a row with no key: lse -inf, output 0
        e = torch.exp(s - m)
        lse = m.squeeze(-1) + e.sum(-1).log()
        out = torch.einsum("bgrnm,bgmd->bgrnd", e / e.sum(-1, keepdim=True).clamp_min(1e-30), v.float())
        return out.flatten(1, 2), lse.flatten(1, 2)

    def backward(self, do, q, k, v, out, lse, scale, causal=False, mask=None):
        hk = k.size(1)
        p = torch.exp(self.scores(q, k, scale, causal, mask) - _grouped(lse, hk).unsqueeze(-1))
        do_g = _grouped(do.float(), hk)
        delta = (do_g * _grouped(out.float(), hk)).sum(-1, keepdim=True)  # [b, Hk, rep, n, 1]
        dv = torch.einsum("bgrnm,bgrnd->bgmd", p, do_g)
        ds = p * (torch.einsum("bgrnd,bgmd->bgrnm", do_g, v.float()) - delta) * scale
        dq = torch.einsum("bgrnm,bgmd->bgrnd", ds, k.float()).flatten(1, 2)
        dk = torch.einsum("bgrnm,bgrnd->bgmd", ds, _grouped(q, hk).float())
        return dq, dk, dv


MATH = MathTiles()


def _expand(x, rep: int):
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _fold(dx, rep: int):
    """Sum an expanded K/V gradient [b, Hq, m, d] back over its query heads -> [b, Hk, m, d]."""
    return dx if rep == 1 else dx.unflatten(1, (-1, rep)).sum(2)


class CpuFlashTiles:
    """torch's CPU flash kernel with the log-sum-exp and its backward (GQA native); the math tiles
    for what it cannot take (a mask, a value width other than the key width)."""

    name = "cpu-flash"

    def fuses(self, q, v, mask) -> bool:
        return mask is None and q.size(-1) == v.size(-1)

    def forward(self, q, k, v, scale, causal=False, mask=None):
        if not self.fuses(q, v, mask):
            return MATH.forward(q, k, v, scale, causal, mask)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float()

    def backward(self, do, q, k, v, out, lse, scale, causal=False, mask=None):
        if not self.fuses(q, v, mask):
            return MATH.backward(do, q, k, v, out, lse, scale, causal, mask)
        do, out, lse = do.to(q.dtype).contiguous(), out.to(q.dtype).contiguous(), lse.float().contiguous()
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, scale=scale)
        return tuple(g.float() for g in grads)


class CudaFlashTiles(CpuFlashTiles):
    """torch's CUDA flash kernel (fp16/bf16; K/V expanded per query head, their gradients summed
    back); the math tiles for fp32 and what ``CpuFlashTiles`` leaves to them."""

    name = "cuda-flash"
    DTYPES = (torch.float16, torch.bfloat16)

    def fuses(self, q, v, mask) -> bool:
        return super().fuses(q, v, mask) and q.dtype in self.DTYPES

    def forward(self, q, k, v, scale, causal=False, mask=None):
        if not self.fuses(q, v, mask):
            return MATH.forward(q, k, v, scale, causal, mask)
        rep = q.size(1) // k.size(1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _expand(k, rep), _expand(v, rep), 0.0, causal, False, scale=scale)[:2]
        return out.float(), lse.float()

    def backward(self, do, q, k, v, out, lse, scale, causal=False, mask=None):
        if not self.fuses(q, v, mask):
            return MATH.backward(do, q, k, v, out, lse, scale, causal, mask)
        do, out, lse = do.to(q.dtype).contiguous(), out.to(q.dtype).contiguous(), lse.float().contiguous()
        rep = q.size(1) // k.size(1)
        # not varlen (cumulative lengths undefined, as the forward returns them); no dropout, so the
        # philox seed and offset (shaped as torch's meta function gives them) are not read
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, _expand(k, rep), _expand(v, rep), out, lse, None, None, q.size(2), k.size(2), 0.0, causal,
            seed, offset, scale=scale)
        return dq.float(), _fold(dk.float(), rep), _fold(dv.float(), rep)


CPU_FLASH, CUDA_FLASH = CpuFlashTiles(), CudaFlashTiles()
