"""Multi-head latent attention (layout letter ``M``): DeepSeek-V2/V3, Kimi Linear, Ling.

Queries from a low-rank latent (or directly from x); keys and values from one shared latent
``c`` (kv_lora_rank channels, RMS-normed) expanded per head, plus one RoPE key part
``k_rope`` shared by all heads::

    q_h = W_qb,h norm(W_qa x)          -> [q_nope_h | q_rope_h]      (dn + dr)
    c | k_rope = W_kva x,  c <- norm(c)
    k_h = [W_uk,h c | rope(k_rope)],   v_h = W_uv,h c                (W_kvb = [W_uk; W_uv] per head)
    o = W_o concat_h softmax(q_h.k_h * scale) v_h        [* sigmoid(W_g x)_h  (Ling head gate)]

RoPE variants (``mla.rope``): ``interleaved`` pairs (DeepSeek, Ling), ``half`` (rotate-half),
``none`` (Kimi and GLM-5 use the k_rope channels unrotated). YaRN scales the frequencies, the
cos/sin and the softmax scale as HF's ``rope_type='yarn'`` (``mla.yarn``).

TP splits heads: W_qb, W_kvb, W_g are column-parallel, W_o row-parallel; W_qa, W_kva and the
latent norms are replicated (``ReplicatedLinear``: their outputs' gradients are made identical
on every rank, by the column-parallel linears for the latents and by ``copy_to`` for k_rope).

Decode cache: the normed latent ``c`` [b, T, kv_lora] and the rotated ``k_rope`` [b, T, dr],
not per-head keys/values: (kv_lora + dr) numbers per token instead of heads/tp * (dn + dr +
dv), and the same on every TP rank. Decoding attends in the absorbed form
(``q_nope W_uk . c`` and ``(p c) W_uv^T``), so cached latents are never re-expanded.

Context parallelism: ``c`` and ``k_rope`` of the whole sequence are all-gathered over CP
(r + dr numbers a token) and the local queries attend in the absorbed form, in checkpointed
query tiles (``context_attention.tiled_latent_attention``); masks from global positions.
Packed documents (``info.documents``): no query sees another document, with and without CP.

Parameters per layer (q_lora_rank r_q, kv_lora_rank r, heads H):
    h*r_q + r_q + r_q*H*(dn+dr)   (or h*H*(dn+dr) without r_q)
    + h*(r+dr) + r + r*H*(dn+dv) + H*dv*h  [+ h*H head gate]
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.layers.cache.decode import append_time
from megamoe.core.config import MLAConfig
from megamoe.layers.ops.attention.context import context_shard, tiled_latent_attention
from megamoe.layers.rotary import apply_rotary, apply_rotary_interleaved, cached_yarn_cos_sin, yarn_softmax_scale
from megamoe.parallel import comm
from megamoe.layers.spec import BuildContext, ForwardInfo, ModuleSpec, register_mixer


def latent_attention(q_lat, q_rope, c, k_rope, scale: float, mask: torch.Tensor | None):
    """Absorbed MLA attention over all T latents.

    q_lat [b, s, H, r] (q_nope W_uk), q_rope [b, s, H, dr], c [b, T, r], k_rope [b, T, dr],
    mask [s, T] or [b, s, T] bool (True = may attend) -> [b, s, H, r] (to multiply by W_uv).
    """
    scores = (torch.einsum("bshr,btr->bsht", q_lat, c) + torch.einsum("bshd,btd->bsht", q_rope, k_rope)) * scale
    if mask is not None:
        scores = scores.masked_fill(~(mask if mask.dim() == 3 else mask[None]).unsqueeze(2), float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(c.dtype)
    return torch.einsum("bsht,btr->bshr", p, c)


class MultiLatentAttention(nn.Module):
    """x: [b, s, h] (``[b, s/tp, h]`` under SP) -> same. Inside: [b, s, heads, dim]."""

    def __init__(self, cfg: MLAConfig, ctx: BuildContext, layer_number: int = 0):
        super().__init__()
        self.layer_number = layer_number
        self.heads = cfg.num_heads // ctx.groups.tp_size
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.rope, self.theta, self.yarn = cfg.rope, cfg.rope_theta, cfg.yarn
        self.tp_group = ctx.groups.tp
        h, H, b = ctx.hidden_size, cfg.num_heads, ctx.backend
        eps = cfg.latent_norm_eps or ctx.norm_eps
        dq = self.dn + self.dr
        if cfg.q_lora_rank is None:
            self.linear_q = b.column_linear(ctx, h, H * dq)
            self.linear_q_down = self.q_norm = None
        else:
            self.linear_q_down = b.replicated_linear(ctx, h, cfg.q_lora_rank)
            self.q_norm = b.norm(ctx, cfg.q_lora_rank, eps=eps, zero_centered=False)
            self.linear_q = b.column_linear(ctx, cfg.q_lora_rank, H * dq, sequence_parallel=False)
        self.linear_kv_down = b.replicated_linear(ctx, h, cfg.kv_lora_rank + self.dr)
        self.kv_norm = b.norm(ctx, cfg.kv_lora_rank, eps=eps, zero_centered=False)
        self.linear_kv_up = b.column_linear(ctx, cfg.kv_lora_rank, H * (self.dn + self.dv), sequence_parallel=False)
        self.linear_gate = b.column_linear(ctx, h, H) if cfg.head_gate else None
        self.scale = cfg.softmax_scale or dq ** -0.5 * yarn_softmax_scale(cfg.yarn)
        self.core = b.core_attention(ctx, softmax_scale=self.scale)
        self.latent_core = b.latent_attention(ctx)  # decoding: absorbed attention over cached latents
        self.linear_proj = b.row_linear(ctx, H * self.dv, h)

    # ---- projections --------------------------------------------------------------------

    def rotate(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        """x [b, s, heads, dr] -> rotated as ``mla.rope`` says."""
        if self.rope == "none" or self.dr == 0:
            return x
        cos, sin = cached_yarn_cos_sin(info, self.dr, self.theta, self.yarn)
        return (apply_rotary_interleaved if self.rope == "interleaved" else apply_rotary)(x, cos, sin)

    def project(self, x: torch.Tensor, info: ForwardInfo):
        """x -> q_nope [b, s, H, dn], q_rope [b, s, H, dr] (rotated), the query latent [b, s, r_q]
        (None without q_lora_rank), c [b, s, r] (normed) and k_rope [b, s, dr] (rotated)."""
        q_latent = None
        if self.linear_q_down is None:
            q = self.linear_q(x)
        else:
            q_latent = self.q_norm(self.linear_q_down(x))
            q = self.linear_q(q_latent)
        bsz, s = q.shape[:2]
        q_nope, q_rope = q.view(bsz, s, self.heads, -1).split([self.dn, self.dr], dim=-1)
        c, k_rope = self.linear_kv_down(x).split([self.kv_lora, self.dr], dim=-1)
        k_rope = comm.copy_to(k_rope, self.tp_group)  # shared by this rank's heads: sum its grad over TP
        k_rope = self.rotate(k_rope.unsqueeze(2), info).squeeze(2)
        return q_nope, self.rotate(q_rope, info), q_latent, self.kv_norm(c), k_rope

    def expand(self, c: torch.Tensor, k_rope: torch.Tensor):
        """c [b, T, r], k_rope [b, T, dr] -> k [b, T, H, dn + dr], v [b, T, H, dv]."""
        bsz, t = c.shape[:2]
        k_nope, v = self.linear_kv_up(c).view(bsz, t, self.heads, -1).split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, self.heads, -1)], dim=-1)
        return k, v

    def up_weights(self):
        """W_uk [H, dn, r] and W_uv [H, dv, r] of this rank's heads (for the absorbed form)."""
        w = self.linear_kv_up.effective_weight()  # the linear role's weight as it multiplies (any adapter folded in)
        return w.view(self.heads, self.dn + self.dv, -1).split([self.dn, self.dv], dim=1)

    def absorbed_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bshn,hnr->bshr", q_nope, self.up_weights()[0])

    def absorbed_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bshr,hvr->bshv", o_lat, self.up_weights()[1])

    def finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out [b, s, H, dv] -> head gate, output projection."""
        if self.linear_gate is not None:
            out = out * torch.sigmoid(self.linear_gate(x).float()).to(out.dtype).unsqueeze(-1)
        return self.linear_proj(out.reshape(*out.shape[:2], -1))

    def cached_latents(self, c, k_rope, info: ForwardInfo):
        """The latents of every key the queries may see: appended to the decode cache (decoding),
        all-gathered over the CP group (context parallelism; a prefill under CP caches them), or
        the given ones."""
        cp = context_shard(info)
        if cp is not None:
            c, k_rope = cp.gather(c), cp.gather(k_rope)
        if info.cache is None:
            return c, k_rope
        state = info.cache.layer(self.layer_number)
        # the cache is outside autograd and shared by every rank's heads: keep it as values
        return append_time(state, "c", c), append_time(state, "k_rope", k_rope)

    # ---- forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        q_nope, q_rope, _, c, k_rope = self.project(x, info)
        return self.attend_dense(x, info, q_nope, q_rope, c, k_rope)

    def attend_dense(self, x, info: ForwardInfo, q_nope, q_rope, c, k_rope) -> torch.Tensor:
        """Attention of the projected queries over every key they may see, then the output projection."""
        cp = context_shard(info)  # with a cache: a prefill under CP
        if info.cache is None and cp is None:
            # training / scoring: expanded heads, fused causal attention (packed documents masked)
            k, v = self.expand(c, k_rope)
            out = self.core(torch.cat([q_nope, q_rope], dim=-1), k, v, documents=info.documents)
            return self.finish(out, x)
        # decoding over the cached latents, or CP over the all-gathered ones: the absorbed form.
        # CP gathers the latent, (kv_lora + dr) numbers a token, not H * (dn + dr + dv) expanded
        # keys and values, and never expands the whole sequence's heads on one rank.
        q_lat = self.absorbed_query(q_nope)
        if cp is not None:
            c = comm.copy_to(c, self.tp_group)
            c_all, kr_all = cp.gather(c), cp.gather(k_rope)
            if info.cache is not None:  # a prefill: every rank's latents, or this rank's (a split cache)
                info.cache.layer(self.layer_number).append_prefill(cp, {"c": c, "k_rope": k_rope},
                                                                   {"c": c_all, "k_rope": kr_all})
            o_lat = tiled_latent_attention(self.latent_core, q_lat, q_rope, c_all, kr_all, self.scale,
                                           cp.local_index(x.device), info.documents)
        else:  # the cache is outside autograd and shared by every rank's heads: it keeps values
            state = info.cache.layer(self.layer_number)
            o_lat = state.attend_latent(info.cache, q_lat, q_rope, comm.copy_to(c, self.tp_group), k_rope,
                                        self.latent_core, self.scale)  # padded keys masked
        return self.finish(self.absorbed_output(o_lat), x)


register_mixer("M", ModuleSpec(MultiLatentAttention))
