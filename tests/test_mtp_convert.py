"""Multi-token-prediction layers of every family that ships them, through conversion.

Each case builds a tiny HF model with its MTP layers as released: the decoder blocks are the
extra layers of a model grown by the MTP depths (saved by transformers in the hub layout, then
renamed where the family keeps them: DeepSeek-style ``model.layers.{N+D}.*``, Qwen-style
``mtp.layers.0.*``), plus each depth's norms and projection and, DeepSeek-style, the copies of
the embedding and head. Then:

- import -> megamoe's MTP logits of every depth equal the reference (fp32, <= 1e-4):
  transformers' ``MtpModel`` (deepseek_v3 with two depths, deepseek_v32, glm_moe_dsa,
  bailing_hybrid, qwen3_next, qwen3_5_moe), or for glm5_next, where transformers has none, a plain-torch
  computation of the definition around transformers' decoder layer (streams expanded, merged
  by their mean, as its main stack does);
- export -> every MTP tensor of the source comes back bitwise under its own name.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ATOL = 1e-4
SEQ = 12


def grown_config(small, **changes):
    """``small``'s config class with ``changes`` (more layers for the MTP blocks)."""
    return type(small.config)(**{**small.config.to_dict(), **changes})


def case_deepseek_v3():
    from transformers import DeepseekV3ForCausalLM

    from tests.test_convert_deepseek import randomized, tiny_deepseek_v3

    big = randomized(DeepseekV3ForCausalLM(grown_config(tiny_deepseek_v3(), num_hidden_layers=4)), 3)
    return dict(big=big, n=2, depths=2, style="nextn", key="num_nextn_predict_layers")


def case_deepseek_v32():
    from transformers import DeepseekV32ForCausalLM

    from tests.test_convert_deepseek import randomized, tiny_deepseek_v32

    small = tiny_deepseek_v32()
    big = randomized(DeepseekV32ForCausalLM(grown_config(
        small, num_hidden_layers=3, layer_types=["indexed_attention"] * 3, mlp_layer_types=["sparse", "dense", "sparse"])), 3)
    with torch.no_grad():
        for layer in big.model.layers:
            layer.self_attn.indexer.weights_proj.weight.abs_()
    # transformers' MtpModel builds masks by layer type and has none for DSA's: its causal mask
    return dict(big=big, n=2, depths=1, style="nextn", key="num_nextn_predict_layers",
                hf_mtp=dict(mtp_layer_types=["full_attention"], mtp_mlp_layer_types=["sparse"]), eager=True,
                truncate=dict(layer_types=["indexed_attention"] * 2, mlp_layer_types=["sparse", "dense"]))


def case_glm_moe_dsa():
    from transformers import GlmMoeDsaForCausalLM

    from tests.test_convert_glm5_minimax_m import randomize, tiny_glm_moe_dsa

    small = tiny_glm_moe_dsa()
    types = [*small.config.indexer_types, "full"]  # the MTP layer runs its own indexer
    big = randomize(GlmMoeDsaForCausalLM(grown_config(small, num_hidden_layers=5, indexer_types=types,
                                                      layer_types=None, mlp_layer_types=None)), 3)
    return dict(big=big, n=4, depths=1, style="nextn", key="num_nextn_predict_layers", eager=True, block_tuple=True,
                hf_mtp=dict(mtp_layer_types=["full_attention"], mtp_mlp_layer_types=["sparse"]),
                truncate=dict(indexer_types=types[:4], layer_types=["indexed_attention"] * 4,
                              mlp_layer_types=["dense"] + ["sparse"] * 3))


def case_bailing_hybrid():
    from transformers import BailingHybridForCausalLM

    from tests.test_convert_deepseek import randomized
    from tests.test_convert_kimi_ling import tiny_bailing_hybrid

    types, mlps = ["linear_attention", "full_attention", "full_attention"], ["dense", "sparse", "sparse"]
    unclamped = dict(swiglu_limits=None, swiglu_limits_shared=None)  # one per layer: drawn again
    big = randomized(BailingHybridForCausalLM(grown_config(tiny_bailing_hybrid(), num_hidden_layers=3, layer_types=types,
                                                           mlp_layer_types=mlps, **unclamped)), 3)
    return dict(big=big, n=2, depths=1, style="nextn", key="num_nextn_predict_layers", final_norm="final_layernorm",
                embedding="model.word_embeddings.weight",
                hf_mtp=dict(mtp_layer_types=types[2:], mtp_mlp_layer_types=mlps[2:]),
                truncate=dict(layer_types=types[:2], mlp_layer_types=mlps[:2], swiglu_limits=[0] * 2,
                              swiglu_limits_shared=[0] * 2))


def case_qwen3_next():
    from transformers import Qwen3NextForCausalLM

    from tests.test_convert_qwen import qwen3_next_config, randomized

    small = qwen3_next_config()
    types = [*small.layer_types, "full_attention"]
    cfg = type(small)(**{**small.to_dict(), "num_hidden_layers": 4, "layer_types": types})
    return dict(big=randomized(Qwen3NextForCausalLM(cfg), 3), n=3, depths=1, style="qwen", key="mtp_num_hidden_layers",
                hf_mtp=dict(mtp_layer_types=["full_attention"]), truncate=dict(layer_types=types[:3]))


def case_qwen3_5_moe_text():
    from transformers import Qwen3_5MoeForCausalLM

    from tests.test_convert_qwen import qwen3_5_moe_text_config, randomized

    small = qwen3_5_moe_text_config()
    types = [*small.layer_types, "full_attention"]
    cfg = type(small)(**{**small.to_dict(), "num_hidden_layers": 3, "layer_types": types})
    return dict(big=randomized(Qwen3_5MoeForCausalLM(cfg), 3), n=2, depths=1, style="qwen",
                key="mtp_num_hidden_layers", hf_mtp=dict(mtp_layer_types=["full_attention"]),
                truncate=dict(layer_types=types[:2]))


def case_glm5_next():
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from tests.test_convert_glm_minimax import randomize, tiny_glm5_next

    small = tiny_glm5_next().config
    text = small.text_config.to_dict()
    types, mlps = [*text["layer_types"], "indexed_attention"], [*text["mlp_layer_types"], "sparse"]
    text.update(num_hidden_layers=3, layer_types=types, mlp_layer_types=mlps, indexer_types=["full"] * 3)
    big = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=small.vision_config.to_dict(),
                                                          image_token_id=small.image_token_id))
    randomize(big, 3)
    return dict(big=big.eval(), n=2, depths=1, style="nextn", key="num_nextn_predict_layers", text="text_config",
                prefix="model.language_model.", truncate=dict(layer_types=types[:2], mlp_layer_types=mlps[:2],
                                                              indexer_types=["full"] * 2))


CASES = {"deepseek_v3": case_deepseek_v3, "deepseek_v32": case_deepseek_v32, "glm_moe_dsa": case_glm_moe_dsa,
         "bailing_hybrid": case_bailing_hybrid,
         "glm5_next": case_glm5_next, "qwen3_next": case_qwen3_next, "qwen3_5_moe_text": case_qwen3_5_moe_text}


# ---- the released checkpoint -------------------------------------------------------------------

def depth_weights(hidden: int, depths: int, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """Each depth's enorm, hnorm, eh_proj [h, 2h] and final norm (HF MtpModel's names)."""
    gen = torch.Generator().manual_seed(seed)
    norm = lambda: 1 + 0.1 * torch.randn(hidden, generator=gen)  # noqa: E731
    return [dict(enorm=norm(), hnorm=norm(), eh_proj=0.2 * torch.randn(hidden, 2 * hidden, generator=gen),
                 post_norm=norm()) for _ in range(depths)]


def write_released(case: dict, weights: list[dict], root: Path) -> Path:
    """The grown model saved by transformers, its last layers renamed into the MTP layers."""
    big, n, prefix = case["big"], case["n"], case.get("prefix", "model.")
    big.save_pretrained(root / "big")
    files = sorted((root / "big").glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    out = {}
    for name, t in tensors.items():
        layer = name[len(prefix) + 7:].split(".")[0] if name.startswith(prefix + "layers.") else None
        if layer is None or int(layer) < n:
            out[name] = t
        elif case["style"] == "qwen":
            out[name.replace(f"{prefix}layers.{layer}.", f"mtp.layers.{int(layer) - n}.")] = t
        else:
            out[name] = t  # DeepSeek-style: the MTP block is HF layer N + D
    for d, w in enumerate(weights):
        if case["style"] == "qwen":
            names = dict(enorm="mtp.pre_fc_norm_embedding", hnorm="mtp.pre_fc_norm_hidden", eh_proj="mtp.fc",
                         post_norm="mtp.norm")
        else:
            at = f"{prefix}layers.{n + d}"
            names = dict(enorm=f"{at}.enorm", hnorm=f"{at}.hnorm", eh_proj=f"{at}.eh_proj",
                         post_norm=f"{at}.{case.get('final_norm', 'shared_head.norm')}")
            out[f"{at}.embed_tokens.weight"] = tensors[case.get("embedding", f"{prefix}embed_tokens.weight")].clone()
            out[f"{at}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        out.update({f"{names[k]}.weight": v for k, v in w.items()})
    hf_dir = root / "hf"
    hf_dir.mkdir()
    save_file(out, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "big" / "config.json").read_text())
    text = config[case["text"]] if "text" in case else config
    text.update(num_hidden_layers=n, **case.get("truncate", {}), **{case["key"]: case["depths"]})
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir


# ---- references ----------------------------------------------------------------------------------

@torch.no_grad()
def hf_reference(case: dict, weights: list[dict], ids: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's logits at the positions whose tokens ahead are known, by transformers' MtpModel."""
    from transformers.modeling_layers import MtpModel

    big, n = case["big"], case["n"]
    for key, value in {"num_mtp_layers": case["depths"], **case.get("hf_mtp", {})}.items():
        setattr(big.config, key, value)
    if case.get("eager"):
        big.config._attn_implementation = "eager"
    mtp = MtpModel(big, case["depths"]).eval()
    for d, w in enumerate(weights):
        layer = mtp.layers[d]
        layer.mtp_block.load_state_dict(big.model.layers[n + d].state_dict())
        if case.get("block_tuple"):  # GLM-5's layer also returns its indexer's selection
            layer.mtp_block = FirstOutput(layer.mtp_block)
        for name, t in w.items():
            getattr(layer, name).weight.copy_(t)
    hidden = main_hidden(big, n, ids)
    pos, out = torch.arange(ids.size(1))[None], []
    for k in range(case["depths"]):
        s = ids.size(1) - k - 1
        hidden = mtp.forward_layer(k, hidden[:, :s], pos[:, :s] + k + 1, None, input_ids=ids[:, k + 1:])
        out.append(mtp._project_to_logits(hidden))
    return out


class FirstOutput(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return self.block(*args, **kwargs)[0]


def main_hidden(big, n: int, ids: torch.Tensor) -> torch.Tensor:
    """The final-normed hidden states of the model's first ``n`` layers (the released model)."""
    decoder = big.get_decoder()
    layers, decoder.layers = decoder.layers, decoder.layers[:n]
    decoder.config.num_hidden_layers, full = n, decoder.config.num_hidden_layers
    try:
        return decoder(input_ids=ids).last_hidden_state
    finally:
        decoder.layers, decoder.config.num_hidden_layers = layers, full


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def glm_reference(case: dict, weights: list[dict], ids: torch.Tensor) -> list[torch.Tensor]:
    """GLM-5's MTP by the definition (megamoe.model.mtp): the projection enters every residual stream of
    transformers' decoder layer, the streams' mean is normed and read by the shared head."""
    big, n = case["big"], case["n"]
    lm, cfg = big.model.language_model, big.config.text_config
    hidden = main_hidden(big, n, ids)
    pos, out = torch.arange(ids.size(1))[None], []
    for k, w in enumerate(weights):
        s = ids.size(1) - k - 1
        emb, h = lm.embed_tokens(ids[:, k + 1:]), hidden[:, :s]
        x = torch.cat([rms(emb, w["enorm"], cfg.rms_norm_eps), rms(h, w["hnorm"], cfg.rms_norm_eps)], -1) @ w["eh_proj"].T
        streams = x.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        y, _ = lm.layers[n + k](streams, attention_mask=torch.ones(1, s, dtype=torch.bool), position_ids=pos[:, :s] + k + 1,
                                position_embeddings=None, input_ids=ids[:, k + 1:], cache=None, prev_topk_indices=None)
        hidden = rms(y.mean(2), w["post_norm"], cfg.rms_norm_eps)
        out.append(big.lm_head(hidden))
    return out


# ---- the test -----------------------------------------------------------------------------------

def mtp_names(names, case: dict) -> set[str]:
    prefix, n = case.get("prefix", "model."), case["n"]
    return {x for x in names if x.startswith("mtp.") or
            (x.startswith(prefix + "layers.") and int(x[len(prefix) + 7:].split(".")[0]) >= n)}


@pytest.mark.parametrize("family", list(CASES))
def test_mtp_layers_import_match_the_reference_and_export_bitwise(family, tmp_path):
    from megamoe.convert import export_hf, import_hf
    from megamoe.model.mtp import mtp_logits
    from tests.conversion_harness import load_converted

    case = CASES[family]()
    hidden = case["big"].config.get_text_config().hidden_size
    weights = depth_weights(hidden, case["depths"])
    hf_dir = write_released(case, weights, tmp_path)
    model = load_converted(import_hf(hf_dir, tmp_path / "mm", progress=False))
    assert model.config.mtp.num_layers == case["depths"]
    ids = torch.randint(3, 64, (1, SEQ), generator=torch.Generator().manual_seed(2))
    want = (glm_reference if family == "glm5_next" else hf_reference)(case, weights, ids)
    with torch.no_grad():
        got = mtp_logits(model, ids)[1:]
    for k, (g, w) in enumerate(zip(got, want)):
        err = (g[:, : w.size(1)] - w).abs().max().item()
        assert err <= ATOL, f"{family} depth {k}: max abs {err:.2e}"
    back = export_hf(tmp_path / "mm", tmp_path / "back", progress=False)
    source = load_file(hf_dir / "model.safetensors")
    exported = {k: v for f in sorted(back.glob("*.safetensors")) for k, v in load_file(f).items()}
    names = mtp_names(source, case)
    assert names == mtp_names(exported, case) and len(names) > 10
    for name in sorted(names):
        assert torch.equal(source[name], exported[name]), name
    config = json.loads((back / "config.json").read_text())
    assert (config[case["text"]] if "text" in case else config)[case["key"]] == case["depths"]


def test_peft_export_leaves_the_mtp_adapters_out(tmp_path, caplog):
    """LoRA on every module of a deepseek_v3 with its MTP layers (the default targets adapt them
    too): the PEFT adapter holds the main model's, which PEFT applies to transformers' model (it
    has no MTP layers) to give megamoe's main logits; the MTP adapters are named as left out."""
    import logging

    from peft import PeftModel

    from megamoe.convert import from_hf
    from megamoe.diagnostics.verify import load_hf_model
    from megamoe.lora import LoRAConfig, apply_lora
    from megamoe.convert import export_peft
    from tests.lora_utils import randomize_adapters

    case = case_deepseek_v3()
    hf_dir = write_released(case, depth_weights(32, case["depths"]), tmp_path)
    model = apply_lora(from_hf(hf_dir), LoRAConfig(rank=2, targets=["*"]))
    randomize_adapters(model)
    assert any(n.startswith("mtp.") and "lora_" in n for n, _ in model.named_parameters())
    with caplog.at_level(logging.WARNING, logger="megamoe.convert.peft"):
        export_peft(model, tmp_path / "peft")
    assert any("multi-token-prediction" in r.getMessage() for r in caplog.records)
    ids = torch.randint(3, 64, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(load_hf_model(hf_dir), str(tmp_path / "peft")).eval()(input_ids=ids).logits
        assert (model(ids) - theirs).abs().max() <= ATOL
