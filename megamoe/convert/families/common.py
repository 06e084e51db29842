"""Building blocks shared by the family tables: HF config readers and rule groups for the
parts most families have in common (embeddings, norms, GQA attention, SwiGLU MLP, MoE)."""
from __future__ import annotations

import copy

import torch

from megamoe.core.config import ModelConfig, YarnConfig
from megamoe.convert.family import hf_get
from megamoe.core.errors import CheckpointError
from megamoe.convert.table import Cat, Ctx, Experts, Fn, OneOf, Rule, Same

# ---- HF config readers -------------------------------------------------------------------


def rope_theta(hf: dict, default: float = 10000.0) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta") or hf.get("rope_theta") or default)


def partial_rotary(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)


def rope_parameters(hf: dict) -> dict:
    """RoPE settings: ``rope_parameters`` (transformers 5) over the legacy ``rope_scaling``."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def yarn_from_hf(hf: dict) -> YarnConfig:
    """``rope_type: yarn`` settings as HF's ``_compute_yarn_parameters`` reads them."""
    p = rope_parameters(hf)
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind == "default":
        return YarnConfig()
    if kind != "yarn":
        raise CheckpointError(f"config.json: rope_parameters.rope_type={kind!r} is not supported "
                              f"(allowed: default, yarn)")
    for key, bad in (("truncate", p.get("truncate", True) is False), ("attention_factor", p.get("attention_factor"))):
        if bad:
            raise CheckpointError(f"config.json: rope_parameters.{key}={p[key]!r} is not supported (megamoe's YaRN "
                                  f"truncates the ramp and derives the attention factor from mscale)")
    original = p.get("original_max_position_embeddings") or hf_get(hf, "original_max_position_embeddings")
    factor = p.get("factor") or hf_get(hf, "max_position_embeddings") / original
    # HF scales cos/sin by mscale(f, mscale) / mscale(f, mscale_all_dim) only when both are set;
    # megamoe does the same with mscale=0 standing for "not set"
    return YarnConfig(factor=float(factor), original_max_position=int(original),
                      beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                      mscale=float(p.get("mscale") or 0.0), mscale_all_dim=float(p.get("mscale_all_dim") or 0.0))


def rope_to_hf(theta: float, yarn: YarnConfig, out: dict) -> None:
    """``rope_parameters`` (and no legacy ``rope_scaling``) for ``theta`` and ``yarn``; the
    original's other RoPE keys (partial_rotary_factor, mrope_section ...) are kept."""
    yarn_keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                 "attention_factor", "truncate", "type")
    kept = {k: v for k, v in rope_parameters(out).items() if k not in yarn_keys}
    params = {**kept, "rope_type": "default", "rope_theta": theta}
    if yarn.factor > 1:
        params.update(rope_type="yarn", factor=yarn.factor, original_max_position_embeddings=yarn.original_max_position,
                      beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow)
        params.update({k: v for k, v in (("mscale", yarn.mscale), ("mscale_all_dim", yarn.mscale_all_dim)) if v})
    out.pop("rope_scaling", None)
    out["rope_parameters"] = params
    if "rope_theta" in out:
        out["rope_theta"] = theta


def dtype_name(hf: dict) -> str:
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def base_hf_config(cfg: ModelConfig, original: dict | None, model_type: str, architecture: str) -> dict:
    """Start of an exported config.json: the original one when there is one."""
    out = copy.deepcopy(original) if original else {}
    out["model_type"] = model_type
    out["architectures"] = [architecture]
    out.setdefault("dtype", cfg.params_dtype)
    return out


def layer_types_layout(types: list[str], letters: dict[str, str], mlp_letters: list[str]) -> str:
    """A layout string from HF per-layer types (``letters`` maps an HF type to a mixer letter)."""
    return "".join(letters[t] + m for t, m in zip(types, mlp_letters))


def type_letters(types: list, key: str, table: dict[str, str], n: int) -> list[str]:
    """One layout letter per layer from an HF per-layer type list (``table``: type -> letter); a
    list of the wrong length or an unknown type is one line naming ``key``."""
    bad = [t for t in types if t not in table]
    if len(types) != n or bad:
        raise CheckpointError(f"config.json: {key}={types} must give one of {list(table)} for each of "
                              f"num_hidden_layers={n} layers")
    return [table[t] for t in types]


def text_config(hf: dict) -> dict:
    """The text part of an HF config (multimodal configs nest it under text_config)."""
    return hf.get("text_config") or hf


# ---- rule groups ---------------------------------------------------------------------------

def embedding_rules(cfg: ModelConfig, prefix: str = "model.", head: str = "lm_head.weight",
                    norm: str = "norm.weight") -> list[Rule]:
    rules = [Same("embedding.weight", f"{prefix}embed_tokens.weight"), Same("final_norm.weight", f"{prefix}{norm}")]
    if not cfg.tie_embeddings:
        rules.append(Same("output_layer.weight", head))
    return rules


def norm_rules(prefix: str, letters: str, input_norm: str = "input_layernorm",
               post_norm: str = "post_attention_layernorm", mlp_letters: str = "de") -> list[Rule]:
    return [Same("layers.{L}.input_norm.weight", f"{prefix}.{input_norm}.weight", when=letters),
            Same("layers.{L}.pre_mlp_norm.weight", f"{prefix}.{post_norm}.weight", when=mlp_letters)]


def _qkv_dims(ctx: Ctx):
    a = ctx.cfg.attention
    d = a.dim(ctx.cfg.hidden_size)
    kv = a.kv_heads()
    return kv, a.num_heads // kv, d, d * (2 if a.output_gate else 1)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """HF q (heads*[q|gate]), k, v rows -> megamoe's per-KV-group [q... | k | v] rows."""
    kv, rep, d, qw = _qkv_dims(ctx)
    tail = q.shape[1:]
    return torch.cat([q.reshape(kv, rep * qw, *tail), k.reshape(kv, d, *tail), v.reshape(kv, d, *tail)],
                     dim=1).reshape(-1, *tail)


def split_qkv(w: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, ...]:
    kv, rep, d, qw = _qkv_dims(ctx)
    tail = w.shape[1:]
    q, k, v = w.reshape(kv, rep * qw + 2 * d, *tail).split([rep * qw, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def attention_rules(prefix: str, letters: str = "AS", q_norm: str | None = "q_norm",
                    k_norm: str | None = "k_norm", bias: bool = False) -> list[Rule]:
    """GQA attention (layers/mixers/attention.py) from HF q/k/v/o projections (+ QK-norm)."""
    rules: list[Rule] = [
        Fn("layers.{L}.mixer.linear_qkv.weight", tuple(f"{prefix}.{x}_proj.weight" for x in "qkv"), when=letters,
           forward=lambda t, ctx: fuse_qkv(*t, ctx), backward=split_qkv),
        Same("layers.{L}.mixer.linear_proj.weight", f"{prefix}.o_proj.weight", when=letters),
    ]
    if bias:
        rules.append(Fn("layers.{L}.mixer.linear_qkv.bias", tuple(f"{prefix}.{x}_proj.bias" for x in "qkv"),
                        when=letters, forward=lambda t, ctx: fuse_qkv(*t, ctx), backward=split_qkv))
    if q_norm:
        rules += [Same("layers.{L}.mixer.q_norm.weight", f"{prefix}.{q_norm}.weight", when=letters),
                  Same("layers.{L}.mixer.k_norm.weight", f"{prefix}.{k_norm}.weight", when=letters)]
    return rules


def dense_mlp_rules(prefix: str, letters: str = "d") -> list[Rule]:
    """SwiGLU MLP (layers/mlp/dense.py): gate|up fused as linear_fc1, down as linear_fc2."""
    return [Cat("layers.{L}.mlp.linear_fc1.weight", (f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"),
                when=letters),
            Same("layers.{L}.mlp.linear_fc2.weight", f"{prefix}.down_proj.weight", when=letters)]


def _cat_gate_up(t, ctx):
    return torch.cat(t, dim=0)


def _split_gate_up(w, ctx):
    return w.chunk(2, dim=0)


def expert_rules(prefix: str, stacked_prefix: str, expert_names: tuple[str, str, str] = ("gate_proj", "up_proj",
                 "down_proj"), letters: str = "e") -> list[Rule]:
    """The two stacked routed-expert tensors from HF's per-expert ``{prefix}.experts.{E}.<name>``
    or stacked ``{stacked_prefix}.experts.gate_up_proj`` / ``.down_proj``."""
    mlp = "layers.{L}.mlp"
    g, u, d = (f"{prefix}.experts.{{E}}.{n}.weight" for n in expert_names)
    return [Experts(f"{mlp}.experts.gate_up_weight", (g, u), when=letters,
                    stacked=(f"{stacked_prefix}.experts.gate_up_proj",), per_expert=_cat_gate_up,
                    split_expert=_split_gate_up, row_blocks=True),
            Experts(f"{mlp}.experts.down_weight", (d,), when=letters, stacked=(f"{stacked_prefix}.experts.down_proj",),
                    per_expert=lambda t, ctx: t[0], split_expert=lambda w, ctx: [w], row_blocks=True)]


def moe_rules(prefix: str, letters: str = "e", *, stacked_prefix: str | None = None,
              expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), gate: str = "gate",
              shared: str | None = None, shared_gate: str | None = None, expert_bias: str | None = None
              ) -> list[Rule]:
    """Routed experts (layers/mlp/moe.py) from HF's router ``{prefix}.{gate}.weight`` and experts,
    per-expert ``{prefix}.experts.{E}.<gate|up|down>.weight`` (``expert_names``) or stacked
    ``{stacked_prefix}.experts.gate_up_proj`` [E, 2F, h] / ``.down_proj`` [E, h, F]
    (``stacked_prefix``: where the stacked layout keeps them, default ``prefix``).
    ``shared``: the shared-expert SwiGLU's module, ``shared_gate``: its sigmoid gate [1, h],
    ``expert_bias``: the router's selection bias (``e_score_correction_bias``), all under ``prefix``."""
    mlp, st = "layers.{L}.mlp", stacked_prefix or prefix
    router = Same(f"{mlp}.router.weight", f"{prefix}.{gate}.weight", when=letters)
    if st != prefix:  # e.g. Mixtral: block_sparse_moe.gate (per-expert layout) or mlp.gate (stacked)
        router = OneOf(router, Same(f"{mlp}.router.weight", f"{st}.{gate}.weight", when=letters))
    rules: list[Rule] = [router, *expert_rules(prefix, st, expert_names, letters)]
    if expert_bias:
        bias = Same(f"{mlp}.router.expert_bias", f"{prefix}.{expert_bias}", when=letters)
        if st != prefix:  # e.g. MiniMax-M2: block_sparse_moe.e_score_correction_bias (hub) or mlp.* (stacked)
            bias = OneOf(bias, Same(f"{mlp}.router.expert_bias", f"{st}.{expert_bias}", when=letters))
        rules.append(bias)
    if shared:
        rules += [Cat(f"{mlp}.shared_experts.linear_fc1.weight",
                      (f"{prefix}.{shared}.gate_proj.weight", f"{prefix}.{shared}.up_proj.weight"), when=letters),
                  Same(f"{mlp}.shared_experts.linear_fc2.weight", f"{prefix}.{shared}.down_proj.weight", when=letters)]
    if shared_gate:
        rules.append(Same(f"{mlp}.shared_gate", f"{prefix}.{shared_gate}.weight", when=letters))
    return rules
