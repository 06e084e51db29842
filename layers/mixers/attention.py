"""Softmax self-attention with GQA (layout letters ``A`` and, with a sliding window, ``S``).

Options: sigmoid output gate computed from the query projection (Qwen3-Next full attention),
QK-norm (RMSNorm over head_dim, or over all heads at once, MiniMax-M2: the backend's
``sharded_norm``, whose statistics are all-reduced over TP), partial rotary, QKV bias, YaRN RoPE scaling
(``attention.yarn``: frequencies and the cos/sin factor as HF's ``rope_type='yarn'``; the
softmax scale is unchanged, as in HF's Qwen/Llama attention).

Context parallelism and packed documents: ``CoreAttention`` (ring attention over the CP group,
masks from global positions and document ids; ``megamoe.layers.ops.attention.context``).

Fused QKV layout, one block per KV group g (so TP splits whole groups)::

    [ q_{g,0} (gate_{g,0}) ... q_{g,n-1} (gate_{g,n-1}) | k_g | v_g ]

Parameters per layer: hidden * (heads*(1+gate) + 2*kv_heads) * head_dim  (QKV)
                      + heads * head_dim * hidden  (output) [+ 2*head_dim QK-norm;
                      scope all: (heads + kv_heads) * head_dim].
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.layers.cache.decode import trim_kv
from megamoe.core.config import AttentionConfig
from megamoe.core.errors import ConfigError
from megamoe.layers.spec import BuildContext, ForwardInfo, ModuleSpec, register_mixer
from megamoe.layers.ops.attention.context import context_shard
from megamoe.layers.rotary import apply_rotary, cached_cos_sin, cached_yarn_cos_sin


class SelfAttention(nn.Module):
    """x: [b, s, h] (``[b, s/tp, h]`` under SP) -> same shape. Inside: [b, s, heads, head_dim]."""

    def __init__(self, cfg: AttentionConfig, ctx: BuildContext, layer_number: int = 0, *,
                 sliding: bool = False):
        super().__init__()
        self.layer_number = layer_number
        tp = ctx.groups.tp_size
        self.head_dim = d = cfg.dim(ctx.hidden_size)
        self.heads, self.kv_heads = cfg.num_heads // tp, cfg.kv_heads() // tp
        self.n_rep = cfg.num_heads // cfg.kv_heads()
        self.gate = cfg.output_gate
        self.q_width = d * (2 if self.gate else 1)
        self.group_width = self.n_rep * self.q_width + 2 * d
        self.rot_dim, self.theta, self.yarn = cfg.rotary_dim(ctx.hidden_size), cfg.rope_theta, cfg.yarn
        self.mrope_section = cfg.mrope_section  # used when positions are [3, b, s]
        b = ctx.backend
        self.linear_qkv = b.column_linear(ctx, ctx.hidden_size, cfg.kv_heads() * self.group_width,
                                          bias=cfg.qkv_bias)
        self.qk_norm_all = cfg.qk_norm_scope == "all"
        if cfg.qk_norm and self.qk_norm_all:  # one norm over all heads: statistics over TP
            self.q_norm = b.sharded_norm(ctx, cfg.num_heads * d)
            self.k_norm = b.sharded_norm(ctx, cfg.kv_heads() * d)
        elif cfg.qk_norm:
            self.q_norm = b.norm(ctx, d, head_sharded=True)
            self.k_norm = b.norm(ctx, d, head_sharded=True)
        else:
            self.q_norm = self.k_norm = None
        self.window = window = cfg.sliding_window if sliding else 0
        if sliding and window <= 0:
            raise ConfigError("model.attention.sliding_window must be > 0 for 'S' layers")
        scale = cfg.softmax_scale or d ** -0.5
        self.core = b.core_attention(ctx, softmax_scale=scale, window=window)
        self.linear_proj = b.row_linear(ctx, cfg.num_heads * d, ctx.hidden_size)

    def project(self, x: torch.Tensor, info: ForwardInfo):
        """x [b, s, h] -> q [b, s, heads, d], k, v [b, s, kv_heads, d], gate [b, s, heads*d] | None."""
        qkv = self.linear_qkv(x)
        bsz, s = qkv.shape[:2]
        d = self.head_dim
        qkv = qkv.view(bsz, s, self.kv_heads, self.group_width)
        q, k, v = qkv.split([self.n_rep * self.q_width, d, d], dim=-1)
        q = q.reshape(bsz, s, self.heads, self.q_width)
        gate = None
        if self.gate:
            q, gate = q.split([d, d], dim=-1)
            gate = gate.reshape(bsz, s, self.heads * d)
        if self.q_norm is not None:
            q, k = self.qk_normed(q, self.q_norm), self.qk_normed(k, self.k_norm)
        cos, sin = self.cos_sin(info)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, gate

    def cos_sin(self, info: ForwardInfo):
        """This layer's RoPE tables [b, s, rot] (shared with every layer of the same parameters)."""
        if self.yarn.factor > 1:  # YaRN frequencies and cos/sin scale (as HF's rope_type='yarn')
            return cached_yarn_cos_sin(info, self.rot_dim, self.theta, self.yarn)
        return cached_cos_sin(info, self.rot_dim, self.theta, sections=self.mrope_section)

    def qk_normed(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """x [b, s, heads, d] normed per head, or (``qk_norm_scope: all``) over all heads at once."""
        return norm(x.flatten(2)).view_as(x) if self.qk_norm_all else norm(x)

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        cp = context_shard(info)  # with a cache: a prefill under CP
        q, k, v, gate = self.project(x, info)
        if cp is None and info.cache is not None:  # decoding: attend over everything cached so far
            state = info.cache.layer(self.layer_number)
            out = state.attend_kv(info.cache, q, k, v, self.core, self.window)  # [b, s, heads, d]
            if self.window:  # 'S': later queries look back at most window - 1 keys
                trim_kv(state, self.window - 1)
        else:  # training / scoring: under CP ring attention, packed documents masked
            if info.cache is not None:  # prefill under CP: every rank's keys, or this rank's (a split cache)
                state = info.cache.layer(self.layer_number)
                state.append_prefill(cp, {"k": k, "v": v})
                if self.window:
                    trim_kv(state, self.window - 1)
            out = self.core(q, k, v, cp=cp, documents=info.documents)
        out = out.reshape(*out.shape[:2], -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.linear_proj(out)


register_mixer("A", ModuleSpec(SelfAttention))
register_mixer("S", ModuleSpec(SelfAttention, params={"sliding": True}))
