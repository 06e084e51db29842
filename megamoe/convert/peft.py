"""Export adapters to HF PEFT: ``adapter_config.json`` + ``adapter_model.safetensors`` that
``peft.PeftModel.from_pretrained`` loads on the family's transformers model.

Names come from the family's conversion table, resolved against the parameter names of the
transformers model itself (built on the meta device), so the adapter targets what PEFT sees in
memory: ``nn.Linear`` modules go to ``target_modules``; stacked expert tensors (transformers 5's
``experts.gate_up_proj`` [E, 2f, h], ``experts.down_proj`` [E, h, f]) go to
``target_parameters``, PEFT's ``ParamWrapper`` layout (lora_A [E*r, in] with expert e in rows
e*r..(e+1)*r-1, lora_B [out, r*E] with column k*E+e; a module with several targeted tensors
nests one wrapper per tensor, the last registered outermost).

Fused megamoe weights whose HF counterparts are separate tensors (QKV, gate|up, GDN in_proj)
are split exactly: the table's transform is probed with index tensors to find which megamoe
rows and columns make each HF tensor (verified on a random tensor; a transform that is not such
a gather is refused). With ``delta = B A`` and ``W_hf = W[rows][:, cols]``, the HF adapter is
``B[rows]``, ``A[:, cols]``: for a column-parallel base the HF modules share A and split B, for
a row-parallel one they share B and split A. Shared expert adapters are written per expert.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from megamoe.convert.family import get_family
from megamoe.core.files import AtomicDir, check_apart
from megamoe.convert.table import Experts, expand
from megamoe.core.errors import CheckpointError
from megamoe.lora.adapters import EXPERT_WEIGHTS
from megamoe.lora.config import LoRAConfig

log = logging.getLogger(__name__)

PREFIX = "base_model.model."


# ---- which megamoe rows and columns each HF tensor holds ----------------------------------

def _gather_maps(transform, rows: int, cols: int, what: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For ``transform``: [1, rows, cols] -> HF tensors [1?, a, b], the (row index [a], column
    index [b]) of each output in the input; raises unless every output is such a gather."""
    shape = (1, rows, cols)
    r_probe = torch.arange(rows, dtype=torch.float64).view(1, rows, 1).expand(shape).contiguous()
    c_probe = torch.arange(cols, dtype=torch.float64).view(1, 1, cols).expand(shape).contiguous()
    check = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    maps = []
    for r_out, c_out, v_out in zip(transform(r_probe), transform(c_probe), transform(check)):
        r_out, c_out, v_out = (t.reshape(t.shape[-2:]) for t in (r_out, c_out, v_out))
        row_map, col_map = r_out[:, 0].long().clamp(0, rows - 1), c_out[0].long().clamp(0, cols - 1)
        if v_out.shape != (row_map.numel(), col_map.numel()) or not torch.equal(v_out, check[0][row_map][:, col_map]):
            raise CheckpointError(f"export_peft: the conversion of {what} is not a row/column selection "
                                  f"(transposed or computed), so its adapter cannot be split exactly")
        maps.append((row_map, col_map))
    return maps


def _rule_and_ctx(entry):
    rule = entry.rule
    if hasattr(rule, "rules"):  # OneOf: the variant found among the HF names
        rule = rule.rules[entry.ctx.variant]
    return rule, entry.ctx


def _hf_factors(entry, a: torch.Tensor, b: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF tensor name, A_hf, B_hf) for one adapted megamoe weight. Linear: a [r, in], b [out, r];
    experts: a [E, r, in], b [E, out, r] -> per HF tensor stacked [E, ...] (or one per expert)."""
    rule, ctx = _rule_and_ctx(entry)
    rows, cols = b.size(-2), a.size(-1)
    if not isinstance(rule, Experts):
        maps = _gather_maps(lambda t: rule.to_hf(t[0], ctx), rows, cols, entry.mm)
        return [(name, a[:, c], b[r]) for name, (r, c) in zip(entry.hf, maps)]
    if ctx.stacked:
        maps = _gather_maps(lambda t: rule.to_hf_stacked(t, ctx), rows, cols, entry.mm)
        return [(name, a[:, :, c], b[:, r]) for name, (r, c) in zip(entry.hf, maps)]
    maps = _gather_maps(lambda t: rule.to_hf(t, ctx), rows, cols, entry.mm)  # one expert's tensors
    k = len(maps)
    return [(entry.hf[e * k + j], a[e][:, c], b[e][r]) for e in range(a.size(0)) for j, (r, c) in enumerate(maps)]


# ---- the transformers model's in-memory parameters ----------------------------------------

def _hf_layout(family, hf_config: dict) -> tuple[dict, dict]:
    """({param name: (module name, is nn.Linear weight, shape)}, {module name: [param names in
    registration order]}) of the family's transformers model, built on the meta device."""
    import transformers

    kwargs = {k: v for k, v in hf_config.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **kwargs)
    cls = getattr(transformers, family.architecture)
    with torch.device("meta"):
        model = cls(config)
    params, order = {}, {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            params[full] = (mod_name, isinstance(module, torch.nn.Linear) and p_name == "weight", tuple(p.shape))
            order.setdefault(mod_name, []).append(full)
    return params, order


# ---- writing ------------------------------------------------------------------------------

def _peft_renamed_leaves(model_type: str) -> set[str]:
    """Module names PEFT rewrites in ``target_modules`` for this model type: it reads them as
    transformers-4 per-expert projections and retargets the stacked experts (so a dense MLP's or
    a shared expert's ``gate_proj`` would be lost). Those modules are targeted through
    ``target_parameters`` (``<module>.weight``) instead, which PEFT leaves as they are and which
    gives the same ``lora_A``/``lora_B`` on a 2-D weight."""
    try:
        from peft.utils.transformers_weight_conversion import (_MODEL_TO_CONVERSION_PATTERN,
                                                                _MOE_TARGET_MODULE_MAPPING)
    except ImportError:  # a PEFT without the transformers-4 conversion
        return set()
    return set(_MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type), {}))


def _adapted_weights(adapters: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(megamoe weight name, A, B) for every adapted weight; shared expert adapters expanded
    to one pair per expert."""
    out = []
    for name in adapters:
        if name.endswith(".lora_A"):
            module = name[: -len(".lora_A")]
            out.append((f"{module}.weight", adapters[name], adapters[f"{module}.lora_B"]))
    for name in adapters:
        for prefix, weight in EXPERT_WEIGHTS.items():
            if name.endswith(f".{prefix}_lora_A"):
                module = name[: -len(f".{prefix}_lora_A")]
                out.append((f"{module}.{weight}", adapters[name], adapters[f"{module}.{prefix}_lora_B"]))
    return out


def peft_tensors(adapters: dict[str, torch.Tensor], model_config, family_name: str, hf_config: dict | None
                 ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(PEFT state dict, target_modules, target_parameters) from full megamoe adapter tensors."""
    family = get_family(family_name, "export_peft")
    config = family.config_to_hf(model_config, hf_config)
    params, order = _hf_layout(family, config)
    entries = {e.mm: e for e in expand(family.rules(model_config, config), model_config, config, set(params))}
    renamed = _peft_renamed_leaves(config["model_type"])
    linear, wrapped = {}, {}  # HF name -> (A, B)
    adapted = _adapted_weights(adapters)
    mtp = [w for w, _, _ in adapted if w.startswith("mtp.")]
    if mtp:  # transformers builds no MTP layers, so PEFT could not load them (export-hf --merge keeps them)
        log.warning("export_peft: the adapters of %d multi-token-prediction weights are left out (%s has no MTP "
                    "layers; export-hf --merge keeps them)", len(mtp), family.architecture)
    for weight, a, b in adapted:
        if weight.startswith("mtp."):
            continue
        if weight not in entries:
            raise CheckpointError(f"export_peft: {family_name} has no HF tensor for adapted weight {weight}")
        if a.dim() == 2 and weight.rsplit(".", 1)[-1] in EXPERT_WEIGHTS.values():  # a shared expert adapter
            n = model_config.moe.num_experts
            a, b = a.expand(n, *a.shape), b.expand(n, *b.shape)
        for hf_name, a_hf, b_hf in _hf_factors(entries[weight], a, b):
            if hf_name not in params:
                raise CheckpointError(f"export_peft: HF tensor {hf_name} (from {weight}) is not a parameter of "
                                      f"{family.architecture}")
            if hf_name in linear or hf_name in wrapped:
                raise CheckpointError(f"export_peft: HF tensor {hf_name} is made of several adapted megamoe weights")
            module, is_linear, _ = params[hf_name]
            as_module = is_linear and module.rsplit(".", 1)[-1] not in renamed
            (linear if as_module else wrapped)[hf_name] = (a_hf, b_hf)
    state = {}
    for hf_name, (a, b) in linear.items():
        module = params[hf_name][0]
        state[f"{PREFIX}{module}.lora_A.weight"] = a.contiguous()
        state[f"{PREFIX}{module}.lora_B.weight"] = b.contiguous()
    for hf_name, (a, b) in wrapped.items():
        module, _, shape = params[hf_name]
        targeted = [p for p in order[module] if p in wrapped]
        depth = len(targeted) - 1 - targeted.index(hf_name)  # the last registered is outermost
        key = f"{PREFIX}{module}." + "base_layer." * depth
        if a.dim() == 3:  # experts: lora_A [E*r, in], lora_B [out, r*E] with column k*E + e
            if tuple(shape[1:]) != (b.size(1), a.size(2)):
                raise CheckpointError(f"export_peft: {hf_name} has shape {list(shape)}, expected "
                                      f"[E, {b.size(1)}, {a.size(2)}] (transposed expert layouts are not supported)")
            a, b = a.reshape(-1, a.size(-1)), b.permute(1, 2, 0).reshape(b.size(1), -1)
        state[f"{key}lora_A.weight"] = a.contiguous()
        state[f"{key}lora_B.weight"] = b.contiguous()
    return state, sorted({params[n][0] for n in linear}), sorted(wrapped)


def base_name(origin: dict | None, fallback: str | None = None) -> str | None:
    """What ``adapter_config.json`` names as the base model: the HF folder the weights were
    imported from, else the HF config's own name, else ``fallback`` (a megamoe checkpoint)."""
    origin = origin or {}
    return origin.get("path") or (origin.get("config") or {}).get("_name_or_path") or fallback


def write_peft(adapters: dict[str, torch.Tensor], model_config, lora: LoRAConfig, family_name: str,
               hf_config: dict | None, out_dir: str | Path, overwrite: bool = False, base: str | None = None,
               inputs=()) -> Path:
    """Write a PEFT adapter directory from full megamoe adapter tensors; ``base``: the
    ``base_model_name_or_path`` it records; ``inputs``: (name, path) read, which it stays apart from."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    state, modules, parameters = peft_tensors(adapters, model_config, family_name, hf_config)
    # PEFT's ParamWrapper (stacked experts) refuses dropout; dropout is a training-time setting
    dropout = 0.0 if parameters else lora.dropout
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=dropout, use_rslora=lora.rslora,
                        target_modules=modules or None, target_parameters=parameters or None, bias="none",
                        task_type="CAUSAL_LM", base_model_name_or_path=base)
    with AtomicDir(out_dir, overwrite, inputs=inputs) as tmp:
        config.save_pretrained(str(tmp))
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
    return Path(out_dir)


def export_peft(model, out_dir: str | Path, *, family: str | None = None, hf_config: dict | None = None,
                groups=None, overwrite: bool = False) -> Path:
    """Write ``model``'s adapters as an HF PEFT adapter for the family it was converted from
    (``model.hf_origin``, or ``family`` + ``hf_config``). Under a parallel layout every rank
    calls it (adapters are gathered); rank 0 writes. A pipeline stage holds only its layers:
    export those from a checkpoint instead (``export_peft_checkpoint``)."""
    import torch.distributed as dist

    from megamoe.lora.api import adapter_state_dict

    if getattr(model, "lora_config", None) is None:
        raise CheckpointError("export_peft: the model has no adapters (apply_lora first)")
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise CheckpointError("export_peft: the model is one pipeline stage; export a checkpoint of the run "
                              "with export_peft_checkpoint (tools/convert.py export-peft)")
    origin = getattr(model, "hf_origin", None) or {}
    family = family or origin.get("model_type")
    if family is None:
        raise CheckpointError("export_peft: the model has no HF origin; pass family= (an HF model_type)")
    adapters = adapter_state_dict(model, groups)
    if dist.is_initialized() and dist.get_rank() != 0:
        return Path(out_dir)
    return write_peft(adapters, model.config, model.lora_config, family,
                      hf_config if hf_config is not None else origin.get("config"), out_dir, overwrite,
                      base_name(origin))


def export_peft_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, *, family: str | None = None,
                           overwrite: bool = False) -> Path:
    """An adapter checkpoint written by a LoRA fine-tune (``step_XXXXXXXX``) -> PEFT directory."""
    from megamoe.checkpoint.dcp import read_full_tensor
    from megamoe.checkpoint.open import open_checkpoint
    from megamoe.core.config_io import config_from_dict
    from megamoe.lora.api import apply_lora, lora_parameters
    from megamoe.model.build import build_model
    from megamoe.parallel.sharding import sharding

    check_apart(out_dir, [("checkpoint", ckpt_dir)])  # before any reading
    ck = open_checkpoint(ckpt_dir)
    if not ck.is_lora:
        raise CheckpointError(f"{ck.path}/meta.json: not a LoRA checkpoint (no 'lora' section)")
    cfg, lora = ck.config, config_from_dict(ck.meta["lora"], LoRAConfig)
    with torch.device("meta"):
        model = apply_lora(build_model(cfg, device="meta"), lora, strict=False)
    adapters = {n: read_full_tensor(ck.path, ck.meta, n, sharding(p)) for n, p in lora_parameters(model)}
    origin = ck.meta.get("hf") or {}
    family = family or origin.get("model_type")
    if family is None:
        raise CheckpointError(f"{ck.path}/meta.json: no HF origin recorded; pass --family")
    return write_peft(adapters, cfg, lora, family, origin.get("config"), out_dir, overwrite,
                      base_name(origin, ck.meta.get("lora_base")), inputs=[("checkpoint", ckpt_dir)])


def read_adapter_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "adapter_config.json").read_text())
