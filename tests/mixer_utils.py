"""Helpers for mixer tests (A, S, L, M, D, I, G, K): tiny configs, building one mixer, decoding it
token by token, TP workers and copying weights from a transformers module."""
from __future__ import annotations

import dataclasses

import torch

from megamoe.layers.cache.decode import InferenceCache
from megamoe.core.config import (AttentionConfig, DSAConfig, GDNConfig, KDAConfig, LightningConfig, MLAConfig,
                                 MLPConfig, ModelConfig, ParallelConfig, YarnConfig)
from megamoe.core.layout import MIXERS
from megamoe.layers.spec import ForwardInfo
from tests.numerics import rel_err


def tiny_model(layout: str = "AdSdLdMdDdId", **kw) -> ModelConfig:
    """Every section the letters A, S, L, M, D, I, G, K read, at test sizes (hidden 32, 4 heads;
    linear mixers in chunks of 8 so that short sequences cross chunks)."""
    base = dict(
        vocab_size=61, hidden_size=32, layout=layout, norm_zero_centered=True,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, output_gate=True,
                                  partial_rotary_factor=0.5, sliding_window=3),
        mlp=MLPConfig(ffn_hidden_size=48),
        lightning=LightningConfig(num_heads=4, block_size=4),
        mla=MLAConfig(num_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
                      v_head_dim=5, yarn=YarnConfig(factor=4.0, original_max_position=8, mscale_all_dim=0.8),
                      indexer=DSAConfig(num_heads=3, head_dim=8, topk=4, kpool=2)),
        gdn=GDNConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12, chunk_size=8),
        kda=KDAConfig(num_heads=2, head_dim=8, conv_kernel=3, chunk_size=8),
    )
    base.update(kw)
    return ModelConfig(**base)


def build_mixer(letter: str, cfg: ModelConfig, groups=None, *, sp: bool = False, layer_number: int = 1,
                seed: int = 0, full_state: dict | None = None):
    """One mixer with weights drawn from ``seed``, norm weights randomised around 1 (so a norm
    weight applied to the wrong channels shows), or loaded from ``full_state`` (unsharded)."""
    from megamoe.model.language_model import build_context
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.layers.spec import build_module, mixer_spec
    from megamoe.model.weights import initialize, load_full_state_dict

    groups = groups or ParallelGroups()
    ctx = build_context(cfg, groups, sequence_parallel=sp)
    mixer = build_module(mixer_spec(letter), getattr(cfg, MIXERS[letter][1]), ctx, layer_number)
    if full_state is not None:
        load_full_state_dict(mixer, full_state, groups)
        return mixer
    initialize(mixer, groups, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(mixer.named_parameters()):
            if p.dim() == 1 and "bias" not in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return mixer


def decode_steps(mixer, x: torch.Tensor, prefill: int = 0) -> torch.Tensor:
    """Run ``x`` [b, T, h] through ``mixer`` with a decode cache: ``prefill`` tokens at once,
    then one token at a time. Returns [b, T, h]."""
    cache = InferenceCache(x.size(0))
    outs = []
    steps = ([prefill] if prefill else []) + [1] * (x.size(1) - prefill)
    start = 0
    for n in steps:
        info = ForwardInfo(positions=cache.positions(n), cache=cache)
        outs.append(mixer(x[:, start:start + n], info))
        cache.advance(n)
        start += n
    return torch.cat(outs, dim=1)


def full_forward(mixer, x: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(x.size(1)).unsqueeze(0).expand(x.size(0), -1)
    return mixer(x, ForwardInfo(positions=pos))


# ---- TP = 2 versus TP = 1, one mixer, run on every rank of a gloo pool ------------------------

def check_sparse_equals_dense(letter: str, cfg: ModelConfig, x: torch.Tensor, rel: float,
                              abs_floor: float = 0.0) -> None:
    """``letter``'s mixer against itself on its dense-mask reference (``dense_reference``), the
    same weights: forward, input gradient and every parameter gradient within ``rel`` (or
    ``abs_floor`` absolute); the indexer gets no gradient (its output is a selection)."""
    sparse, dense = build_mixer(letter, cfg), build_mixer(letter, cfg)
    dense.dense_reference = True
    xs, xd = (x.clone().requires_grad_(True) for _ in range(2))
    ys, yd = full_forward(sparse, xs), full_forward(dense, xd)
    assert rel_err(ys, yd) <= rel
    g = torch.randn(ys.shape, generator=torch.Generator().manual_seed(1))
    (ys * g).sum().backward()
    (yd * g).sum().backward()
    assert rel_err(xs.grad, xd.grad) <= rel
    for (name, a), b in zip(sparse.named_parameters(), dense.parameters()):
        if name.startswith("indexer."):
            assert a.grad is None and b.grad is None, name
        else:
            assert rel_err(a.grad, b.grad) <= rel or (a.grad - b.grad).abs().max().item() <= abs_floor, name


def mixer_tp_case(letter: str, sp: bool, seed: int = 0, mla: dict | None = None,
                  model: dict | None = None) -> dict:
    """Outputs, input gradients and every parameter gradient of a TP=2 mixer against TP=1.
    ``mla``: overrides of the MLA section; ``model``: sections replacing tiny_model's."""
    from megamoe.parallel.groups import build_groups
    from megamoe.model.weights import finalize_grads

    cfg = tiny_model(**(model or {}))
    cfg.mla = dataclasses.replace(cfg.mla, **(mla or {}))
    groups = build_groups(ParallelConfig(tp=2, sequence_parallel=sp))
    ref = build_mixer(letter, cfg, seed=seed)
    state = {name: p.detach().clone() for name, p in ref.named_parameters()}
    par = build_mixer(letter, cfg, groups, sp=sp, full_state=state)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 10, cfg.hidden_size, generator=gen)
    g = torch.randn(2, 10, cfg.hidden_size, generator=gen)
    rank = groups.tp_rank
    local = (lambda t: t.chunk(2, dim=1)[rank]) if sp else (lambda t: t)
    xr, xp = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
    yr, yp = full_forward(ref, xr), par(xp, ForwardInfo(positions=torch.arange(10).expand(2, -1)))
    (yr * g).sum().backward()
    (yp * local(g)).sum().backward()
    finalize_grads(par, groups)
    errs = {"out": rel_err(yp, local(yr)), "grad x": rel_err(xp.grad, local(xr.grad))}
    return param_grad_errors(ref, par, groups, errs)


def param_grad_errors(ref, par, groups, errs: dict, cp_group=None) -> dict:
    """``errs`` plus the relative error of every parameter gradient of ``par`` (sharded over
    ``groups``; with ``cp_group``, each CP rank's share is summed first) against ``ref``'s."""
    import torch.distributed as dist

    from megamoe.parallel.sharding import gather_full

    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        want = ref_params[name].grad
        if want is None:  # the DSA indexer: selection only, no gradient (as in HF)
            errs[f"no grad {name}"] = 0.0 if p.grad is None else 1.0
            continue
        if cp_group is not None:
            dist.all_reduce(p.grad, group=cp_group)  # each CP rank holds its tokens' share
        errs[f"grad {name}"] = rel_err(gather_full(p, groups, p.grad), want)
    return errs


# ---- transformers references ------------------------------------------------------------------

MLA_NAMES = {  # ours -> HF MLA (DeepseekV3Attention and its descendants)
    "linear_q_down.weight": "q_a_proj.weight", "q_norm.weight": "q_a_layernorm.weight",
    "linear_q.weight": "q_b_proj.weight", "linear_kv_down.weight": "kv_a_proj_with_mqa.weight",
    "kv_norm.weight": "kv_a_layernorm.weight", "linear_kv_up.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight", "linear_gate.weight": "g_proj.weight",
}
TOKENS = dict(vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
HF_SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=10, qk_nope_head_dim=6,
                qk_rope_head_dim=4, v_head_dim=5, num_hidden_layers=1, rms_norm_eps=1e-6, **TOKENS)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}


def causal_additive_mask(b: int, s: int) -> torch.Tensor:
    """[b, 1, s, s] float mask for HF eager attention: 0 where allowed, finfo.min elsewhere."""
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    mask = torch.zeros(s, s).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask.expand(b, 1, s, s)


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    """Random weights for an HF module: norms around 1, everything else N(0, std)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.2 * noise if ("norm" in name and name.endswith("weight")) else std * noise)


@torch.no_grad()
def load_from_hf(ours: torch.nn.Module, hf: torch.nn.Module, names: dict[str, str]) -> None:
    """Copy HF tensors into ours; ``names``: our parameter name -> HF parameter name (None: the
    caller fills it). Every one of our parameters must be named (a forgotten one is an error,
    not a silent skip)."""
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        if name not in names:
            raise KeyError(f"no HF tensor named for {name}")
        if names[name] is not None:
            p.copy_(theirs[names[name]].reshape(p.shape))
