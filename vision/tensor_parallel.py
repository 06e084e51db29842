"""Tensor parallelism inside a timm encoder: Megatron's split of each transformer block.

``shard_encoder(model, group)`` rewrites a built (and loaded) timm model in place::

    attention  qkv (and gate) -> column-parallel by head;  proj -> row-parallel
               num_heads, attn_dim -> this rank's share (timm reads them in forward)
    MLP        fc1 (fc1_g, fc1_x; GluMlp's fused halves part by part) -> column-parallel
               fc2 -> row-parallel

Tokens stay ``[b, n, d]`` and replicated on every rank of ``group`` around each block; inside
it each rank holds ``[b, heads/tp, n, head_dim]`` and ``[b, n, ffn/tp]``; the row-parallel
linears all-reduce. Everything else (patch embedding, norms, position embeddings, the
projector) stays replicated with identical gradients, except per-head q/k norms: each rank
sees only its heads, so their gradients are partial sums (``mark_tp_partial_grad``).

Blocks whose sub-layers cannot be split exactly are refused with a one-line error: a norm
over the whole attention or MLP width (timm's ``scale_norm`` / ``scale_mlp``), grouped K/V
heads, heads or widths not divisible by the group size, convolutional MLPs.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.core.errors import ConfigError
from megamoe.parallel.groups import ParallelGroups, group_size
from megamoe.parallel.linear import ColumnParallelLinear, RowParallelLinear
from megamoe.parallel.sharding import mark_tp_partial_grad, sharding, split_full


def _attention_types() -> tuple[type, ...]:
    from timm.layers.attention import Attention, AttentionRope

    return Attention, AttentionRope


def _mlp_types() -> tuple[type, ...]:
    from timm.layers.mlp import GluMlp, Mlp, SwiGLU

    return Mlp, GluMlp, SwiGLU


@torch.no_grad()
def _copy_split(new: nn.Module, old: nn.Linear, groups: ParallelGroups) -> nn.Module:
    """Fill a parallel linear with this rank's piece of a full nn.Linear."""
    new.weight.copy_(split_full(old.weight, sharding(new.weight), groups))
    if old.bias is not None:
        new.bias.copy_(split_full(old.bias, sharding(new.bias), groups))
    return new


def column(old: nn.Linear, group, parts: list[int] | None = None) -> ColumnParallelLinear:
    w = old.weight
    new = ColumnParallelLinear(old.in_features, parts or old.out_features, group, bias=old.bias is not None,
                               dtype=w.dtype, device=w.device)
    return _copy_split(new, old, ParallelGroups(tp=group))


def row(old: nn.Linear, group) -> RowParallelLinear:
    w = old.weight
    new = RowParallelLinear(old.in_features, old.out_features, group, bias=old.bias is not None,
                            dtype=w.dtype, device=w.device)
    return _copy_split(new, old, ParallelGroups(tp=group))


def _require(ok: bool, where: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: cannot split over tensor parallelism: {why}")


def _shard_attention(attn: nn.Module, group, where: str) -> None:
    size = group_size(group)
    _require(isinstance(attn.norm, nn.Identity), where, "a norm over the whole attention width (scale_norm)")
    _require(attn.num_heads % size == 0, where, f"num_heads={attn.num_heads} is not divisible by tp={size}")
    _require(getattr(attn, "num_kv_groups", 1) == 1, where, "grouped K/V heads")
    if getattr(attn, "qkv", None) is not None:
        attn.qkv = column(attn.qkv, group, [attn.attn_dim] * 3)
    else:
        attn.q_proj, attn.k_proj, attn.v_proj = (column(m, group) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    if attn.gate is not None:
        attn.gate = column(attn.gate, group)
    attn.proj = row(attn.proj, group)
    for norm in (attn.q_norm, attn.k_norm):
        for p in norm.parameters():
            mark_tp_partial_grad(p)
    attn.num_heads //= size
    attn.attn_dim //= size
    if hasattr(attn, "num_kv_heads"):
        attn.num_kv_heads //= size
        attn.kv_dim //= size


def _shard_mlp(mlp: nn.Module, group, where: str) -> None:
    from timm.layers.mlp import GluMlp, SwiGLU

    _require(isinstance(mlp.norm, nn.Identity), where, "a norm over the whole MLP width (scale_mlp)")
    _require(isinstance(mlp.fc2, nn.Linear), where, "a convolutional MLP")
    if isinstance(mlp, SwiGLU):
        mlp.fc1_g, mlp.fc1_x = column(mlp.fc1_g, group), column(mlp.fc1_x, group)
    elif isinstance(mlp, GluMlp):
        _require(mlp.chunk_dim == -1, where, "a channels-first GluMlp")
        half = mlp.fc1.out_features // 2
        mlp.fc1 = column(mlp.fc1, group, [half, half])  # each rank chunks its own [x1 | x2]
    else:
        mlp.fc1 = column(mlp.fc1, group)
    mlp.fc2 = row(mlp.fc2, group)


def shard_encoder(model: nn.Module, group, where: str = "model.vision") -> int:
    """Split every attention and MLP block of a timm model over ``group`` (in place); returns
    how many blocks were split. With a group of one (``None``: single-process tools such as
    export on a tensor-parallel checkpoint) the linears become parallel ones holding the whole
    weight, so the parameters carry the same split rules as under the real group."""
    attention, mlps = _attention_types(), _mlp_types()
    split = 0
    for name, mod in list(model.named_modules()):
        kind = type(mod).__name__
        if kind.endswith("Attention") and not isinstance(mod, attention):
            raise ConfigError(f"{where}.parallel.tp={group_size(group)}: encoder module {name} ({kind}) is not a "
                              f"timm Attention/AttentionRope, which are what tensor parallelism splits; use tp=1")
        if isinstance(mod, attention):
            _shard_attention(mod, group, f"{where} encoder module {name} ({type(mod).__name__})")
            split += 1
        elif isinstance(mod, mlps):
            _shard_mlp(mod, group, f"{where} encoder module {name} ({type(mod).__name__})")
            split += 1
    if split == 0:
        raise ConfigError(f"{where}.parallel.tp={group_size(group)}: the encoder has no timm Attention/Mlp "
                          f"blocks to split; use tp=1 with mode replicated or split")
    return split
