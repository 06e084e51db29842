"""Multi-token-prediction layers in the family tables (``model.mtp``, ``megamoe.model.mtp``).

Two checkpoint layouts are released; both are ordinary table rules, so every import path
(streaming, per-rank slicing, FP8 dequantisation) treats MTP tensors like any other:

DeepSeek-style (deepseek_v3, deepseek_v32, glm5_next, bailing_hybrid): depth D is HF layer
``num_hidden_layers + D`` (count: ``num_nextn_predict_layers``)::

    model.layers.{N+D}.enorm | hnorm | eh_proj         -> mtp.{D}.enorm | hnorm | eh_proj
    model.layers.{N+D}.shared_head.norm                -> mtp.{D}.final_norm  (Ling: final_layernorm)
    model.layers.{N+D}.<the family's layer tensors>    -> mtp.{D}.layer.<the same as layers.{L}>
    model.layers.{N+D}.embed_tokens, shared_head.head  -> copies of embedding / output_layer

The copies must equal the model's own tensors (``Copies``: checked bitwise on import, written
back on export), since megamoe's MTP shares them as DeepSeek-V3 defines it.

Qwen-style (qwen3_next, qwen3_5_moe; count: ``mtp_num_hidden_layers``, 1 in every release)::

    mtp.pre_fc_norm_embedding | pre_fc_norm_hidden | fc | norm  -> mtp.0.enorm | hnorm | eh_proj | final_norm
    mtp.layers.0.<the family's layer tensors>                   -> mtp.0.layer.<...>

Qwen's module shares one ``fc`` and its norms among all its layers, which DeepSeek's chain of
depths does not; more than one layer is refused on import.

Each depth's layer kind comes from the HF config's ``mtp_layer_types`` / ``mtp_mlp_layer_types``
(transformers' names) where given, else the family's MTP layer (DeepSeek-V3 ``Me``, V3.2 ``De``,
GLM-5 ``Ie``, Ling ``Me``, Qwen ``Ae``; a model without routed experts: a dense MLP).
"""
from __future__ import annotations

from megamoe.core.config import ModelConfig, MTPConfig
from megamoe.convert.table import Copies, Rule, Same, renamed
from megamoe.core.errors import CheckpointError

MLP_TYPES = {"dense": "d", "sparse": "e"}
NEXTN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_norm": "shared_head.norm"}
QWEN = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "final_norm": "norm"}
COPIES = {"embedding.weight": "embed_tokens.weight", "output_layer.weight": "shared_head.head.weight"}
NEXTN_KEY, QWEN_KEY = "num_nextn_predict_layers", "mtp_num_hidden_layers"


# ---- configs ---------------------------------------------------------------------------------

def mtp_from_hf(hf: dict, key: str, mixer_types: dict[str, str], mixer: str, moe: bool) -> MTPConfig | None:
    """``model.mtp`` from the HF config's depth count ``key`` (None when 0 or absent)."""
    n = hf.get(key) or 0
    if not n:
        return None
    mixers = [_letter(mixer_types, t, "mtp_layer_types") for t in hf.get("mtp_layer_types") or [None] * n]
    mlps = [_letter(MLP_TYPES, t, "mtp_mlp_layer_types") for t in hf.get("mtp_mlp_layer_types") or [None] * n]
    if len(mixers) != n or len(mlps) != n:
        raise CheckpointError(f"config.json: mtp_layer_types / mtp_mlp_layer_types must give one entry for each of "
                              f"{key}={n} layers")
    kinds = [(a or mixer) + (m or ("e" if moe else "d")) for a, m in zip(mixers, mlps)]
    return MTPConfig(num_layers=n, layout=kinds[0] if len(set(kinds)) == 1 else "".join(kinds))


def _letter(types: dict[str, str], value, field: str) -> str | None:
    if value is None:
        return None
    if value not in types:
        raise CheckpointError(f"config.json: {field} entry {value!r} is not supported (allowed: {', '.join(types)})")
    return types[value]


def mtp_to_hf(cfg: ModelConfig, out: dict, key: str, mixer_types: dict[str, str], mixer: str) -> None:
    """The depth count (0 without MTP) and, where they differ from the family's MTP layer, the
    depths' layer types."""
    for name in ("mtp_layer_types", "mtp_mlp_layer_types"):
        out.pop(name, None)
    out[key] = cfg.mtp.num_layers if cfg.mtp is not None else 0
    if cfg.mtp is None:
        return
    kinds = cfg.mtp.kinds()
    names = {letter: name for name, letter in mixer_types.items()}
    bad = [str(k) for k in kinds if k.mixer not in names or k.mlp not in "de"]
    if bad:
        raise CheckpointError(f"export: model.mtp.layout={cfg.mtp.layout!r}: layer {bad[0]} cannot be expressed "
                              f"(mixers {', '.join(names)}; MLPs d, e)")
    default = mixer + ("e" if cfg.moe is not None else "d")
    if any(str(k) != default for k in kinds):
        out["mtp_layer_types"] = [names[k.mixer] for k in kinds]
        out["mtp_mlp_layer_types"] = ["dense" if k.mlp == "d" else "sparse" for k in kinds]


def check_single_qwen_depth(cfg: ModelConfig, model_type: str) -> None:
    if cfg.mtp is not None and cfg.mtp.num_layers != 1:
        raise CheckpointError(f"{model_type}: {QWEN_KEY}={cfg.mtp.num_layers} is not supported (its MTP module shares "
                              f"one fc and its norms among its layers; megamoe's depths each have their own): use 1")


# ---- tables ----------------------------------------------------------------------------------

def layer_rules_at_depths(rules: list[Rule], hf_from: str = "", hf_to: str = "") -> list[Rule]:
    """The family's layer rules (``layers.{L}.*``) again for every depth's decoder layer
    (``mtp.{D}.layer.*``); HF names with ``hf_from`` replaced by ``hf_to`` (none: the depth is
    HF layer ``{L}``, DeepSeek's layout)."""
    mm = lambda p: p.replace("layers.{L}.", "mtp.{D}.layer.", 1)  # noqa: E731
    hf = (lambda p: p.replace(hf_from, hf_to, 1)) if hf_from else (lambda p: p)  # noqa: E731
    return [renamed(r, mm, hf) for r in rules if r.mm.startswith("layers.{L}.")]


def depth_rules(prefix: str, names: dict[str, str]) -> list[Rule]:
    """Each depth's norms and projection (``names``: megamoe module -> HF module under ``prefix``)."""
    return [Same(f"mtp.{{D}}.{ours}.weight", f"{prefix}.{theirs}.weight") for ours, theirs in names.items()]


def with_copies(rules: list[Rule], cfg: ModelConfig, layer: str) -> list[Rule]:
    """``rules`` with the embedding and output rules also reading (and writing) every depth's copy
    under ``layer`` (``{L}`` -> the depth's layer number); checkpoints without copies still import."""
    n = cfg.parsed_layout().num_layers
    produced = {r.mm for r in rules}
    copies: dict[str, list[str]] = {}
    for ours, theirs in COPIES.items():
        target = ours if ours in produced else "embedding.weight"  # tied: the head is the embedding
        copies.setdefault(target, []).extend(f"{layer}.{theirs}".replace("{L}", str(n + d))
                                             for d in range(cfg.mtp.num_layers))
    return [Copies(r.mm, tuple(copies[r.mm]), r.when, r) if r.mm in copies else r for r in rules]


def nextn_table(rules: list[Rule], cfg: ModelConfig, layer: str = "model.layers.{L}",
                names: dict[str, str] = NEXTN) -> list[Rule]:
    """A DeepSeek-style family's table (``rules``) with its MTP depths, if the model has them."""
    if cfg.mtp is None:
        return rules
    return [*with_copies(rules, cfg, layer), *depth_rules(layer, names), *layer_rules_at_depths(rules)]


def qwen_table(rules: list[Rule], cfg: ModelConfig, layer: str, model_type: str) -> list[Rule]:
    """A Qwen-style family's table with its MTP module (``layer``: the family's HF layer prefix,
    e.g. ``model.layers.{L}``), if the model has one."""
    if cfg.mtp is None:
        return rules
    check_single_qwen_depth(cfg, model_type)
    return [*rules, *depth_rules("mtp", QWEN), *layer_rules_at_depths(rules, f"{layer}.", "mtp.layers.{D}.")]
