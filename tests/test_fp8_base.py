"""A frozen FP8 base (``import-hf --keep-fp8``, ``from_hf(keep_fp8=True)``; megamoe.model.fp8_base):
the release's e4m3 weights and block scales kept in memory and in checkpoints, dequantised per
GEMM, under LoRA adapters in the model's dtype.

- import -> the model equals the dequantised import (fp32 logits 1e-6) and transformers (1e-4);
  export-hf --fp8-blocks 128 gives the release back bit for bit, every tensor;
- the frozen base weighs <= 0.55x of the same base in bf16 (measured on the tensors);
- a LoRA fine-tune on the FP8 base follows the one on the dequantised base: the loss at every
  step within 1e-5 (fp32; the two compute the same products, the FP8 one dequantising per GEMM
  and again in the backward), the base stays bitwise; merged and exported with FP8 blocks, the
  tensors LoRA did not touch come back bitwise and transformers reads the export with megamoe's
  logits;
- TP=2 x EP=2 (two gloo ranks, the checkpoint resharded on load; and ``from_hf`` of the FP8
  release under the grid, dequantised and kept) equals one process: logits and every adapter's
  gradient, relative error 1e-5;
- tiered experts (``model.moe.expert_store``) read FP8 experts from the converted ``--keep-fp8``
  checkpoint and from the HF release itself: the dequantised model's loss and gradients, about
  half of bf16's bytes read.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megamoe.convert import export_hf, from_hf, import_hf
from tests.conversion_harness import ATOL, load_converted
from tests.test_convert_fp8 import IDS, ds3_release, fp8_checkpoint, tiny  # noqa: F401 (a fixture)

E4M3 = torch.float8_e4m3fn
STEPS, LOSS_TOL, REL = 8, 1e-5, 1e-5


def _files(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    raw = lambda t: t.view(torch.uint8) if t.dtype == E4M3 else t  # noqa: E731
    return a.dtype == b.dtype and torch.equal(raw(a), raw(b))


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2", "minimax"])
@torch.no_grad()
def test_keep_fp8_import_and_export_give_the_release_back(family, tmp_path):
    from transformers import AutoModelForCausalLM

    fp8_dir, quantised = fp8_checkpoint(tiny(family), tmp_path)
    ckpt = import_hf(fp8_dir, tmp_path / "mm", keep_fp8=True, progress=False)
    stored = _files(ckpt)
    assert sum(t.dtype == E4M3 for t in stored.values()) >= 8  # projections and expert stacks of 2 layers
    model = load_converted(ckpt)
    assert (model(IDS) - from_hf(fp8_dir)(IDS)).abs().max() <= 1e-6
    hf = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()
    assert (model(IDS) - hf(input_ids=IDS).logits).abs().max() <= ATOL
    back = export_hf(ckpt, tmp_path / "back", fp8_blocks=128, progress=False)
    release, exported = _files(fp8_dir), _files(back)
    assert set(release) == set(exported)
    assert [n for n in release if not _bitwise(release[n], exported[n])] == []


@torch.no_grad()
def test_frozen_fp8_base_weighs_about_half_of_bf16(tmp_path):
    """bf16 checkpoint dtype (as released): the kept weights are e4m3 + 4 bytes per row and
    128-column block, everything else bf16 in both."""
    from tests.test_convert_deepseek import randomized
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=256, intermediate_size=512,
                           moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                           v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                           topk_group=1, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    randomized(DeepseekV3ForCausalLM(cfg)).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    from tests.fp8_utils import quantize_like_release

    quantize_like_release(tmp_path / "hf", tmp_path / "fp8")
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in m.state_dict().values())  # noqa: E731
    fp8, bf16 = from_hf(tmp_path / "fp8", keep_fp8=True), from_hf(tmp_path / "fp8")
    assert bf16.embedding.weight.dtype == torch.bfloat16
    ratio = nbytes(fp8) / nbytes(bf16)
    print(f"frozen FP8 base {nbytes(fp8)} bytes / bf16 {nbytes(bf16)} bytes = {ratio:.3f}")
    assert ratio <= 0.55


def _lora(model, targets=("*",), exclude=()):
    from megamoe.lora import LoRAConfig, apply_lora

    return apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=list(targets), exclude=list(exclude)), seed=3)


def _train(model, steps: int) -> list[float]:
    from megamoe.lora import lora_parameters
    from megamoe.model.language_model import shift_labels

    opt = torch.optim.Adam([p for _, p in lora_parameters(model)], lr=1e-2)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(7))  # one batch, learnt
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=shift_labels(ids))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_lora_on_fp8_base_follows_the_dequantised_base(ds3_release, tmp_path):
    from transformers import AutoModelForCausalLM
    from megamoe.convert import to_hf
    from megamoe.lora import merge

    fp8_dir, quantised = ds3_release
    exclude = ["experts"]  # the routed experts keep no adapters: their tensors must come back as they were
    fp8 = _lora(from_hf(fp8_dir, keep_fp8=True).train(), exclude=exclude)
    ref = _lora(from_hf(fp8_dir).train(), exclude=exclude)
    before = {n: t.clone() for n, t in fp8.state_dict().items() if t.dtype == E4M3}
    got, want = _train(fp8, STEPS), _train(ref, STEPS)
    print("loss, FP8 base:", [f"{x:.6f}" for x in got], "dequantised:", [f"{x:.6f}" for x in want])
    assert max(abs(a - b) for a, b in zip(got, want)) <= LOSS_TOL and got[-1] < got[0]
    assert all(_bitwise(before[n], t) for n, t in fp8.state_dict().items() if n in before)
    assert [n for n, p in fp8.named_parameters() if p.requires_grad and p.dtype == E4M3] == []

    with torch.no_grad():
        merge(fp8.eval())
        out = to_hf(fp8, tmp_path / "merged", fp8_blocks=128)
        release, exported = _files(fp8_dir), _files(out)
        experts = [n for n in release if ".experts." in n]
        assert experts and all(_bitwise(release[n], exported[n]) for n in experts)
        assert exported["model.layers.0.self_attn.q_b_proj.weight"].dtype == E4M3
        assert not _bitwise(release["model.layers.0.self_attn.q_b_proj.weight"],
                            exported["model.layers.0.self_attn.q_b_proj.weight"])  # merged, requantised
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert (hf(input_ids=IDS).logits - from_hf(out)(IDS)).abs().max() <= ATOL


# ---- TP=2 x EP=2 on two gloo ranks ------------------------------------------------------------

def fp8_parallel_case(ckpt: str, ids: torch.Tensor, hf_dir: str) -> dict:
    from megamoe.core.config import ParallelConfig
    from megamoe.convert import build_model
    from megamoe.lora import lora_parameters
    from megamoe.model.language_model import shift_labels
    from megamoe.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megamoe.parallel.groups import ParallelGroups, build_groups
    from megamoe.parallel.sharding import gather_full
    from megamoe.core.config_io import config_from_dict
    from megamoe.checkpoint.dcp import load_checkpoint, read_meta
    from megamoe.training.grads import sync_grads
    from tests.numerics import rel_err

    cfg = config_from_dict(read_meta(ckpt)["model"])
    out = {}
    grid = build_groups(ParallelConfig(tp=2, ep=2))
    runs = (("ref", ParallelGroups(), False), ("tp2ep2", grid, False), ("hf", grid, False), ("hf_keep", grid, True))
    for key, groups, keep in runs:
        if key.startswith("hf"):  # from_hf under the grid: each rank keeps its shards of the dequantised / kept weights
            model = from_hf(hf_dir, groups, keep_fp8=keep)
        else:
            model = build_model(cfg, groups)
            load_checkpoint(ckpt, groups, [model], load_rng=False)
        _lora(model.train())
        logits = model.forward_stage(ids)
        vocab_parallel_cross_entropy(logits, shift_labels(ids), groups.tp, cfg.vocab_size).mean().backward()
        if key != "ref":
            sync_grads([model], groups)
        out[key] = {"logits": model.gather_logits(logits).detach(),
                    **{n: gather_full(p, groups, p.grad) for n, p in lora_parameters(model)}}
        if key == "tp2ep2":
            fp8_experts = sum(t.dtype == E4M3 and ".mlp.experts." in n for n, t in model.state_dict().items())
    errs = {f"{key}:{n}": rel_err(out[key][n], want) for key in out if key != "ref" for n, want in out["ref"].items()}
    errs["_fp8_experts"] = fp8_experts
    return errs


def test_fp8_base_tp2_ep2_equals_one_process(pool, ds3_release, tmp_path):
    fp8_dir, _ = ds3_release
    ckpt = import_hf(fp8_dir, tmp_path / "mm", keep_fp8=True, progress=False)
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    for rank, errs in enumerate(pool(2).run(fp8_parallel_case, str(ckpt), ids, str(fp8_dir))):
        assert errs.pop("_fp8_experts") == 2 and len(errs) > 30
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, (rank, bad)


def test_planner_counts_the_fp8_base():
    """megamoe-plan's weights of the 1T preset under LoRA with every linear and expert weight in
    FP8 (``model.fp8_base.tensors=['*']``): about half of bf16; parameters counted once."""
    import dataclasses

    from megamoe.core.config import Fp8BaseConfig, ParallelConfig
    from megamoe.lora import LoRAConfig
    from megamoe.planning.plan import stage_memory
    from megamoe.recipe import load_recipe

    cfg = load_recipe("moe_1t", ["model.params_dtype=bfloat16"]).model
    parallel = ParallelConfig(tp=8, ep=32, pp=4)
    rows = {}
    for key, base in (("bf16", None), ("fp8", Fp8BaseConfig(tensors=["*"]))):
        rows[key] = stage_memory(dataclasses.replace(cfg, fp8_base=base), parallel, 1024, 1, 4096,
                                 lora=LoRAConfig(rank=16))
    weights = [f["weights"] / b["weights"] for f, b in zip(rows["fp8"], rows["bf16"])]
    print("FP8 base weights / bf16 per stage:", [f"{w:.3f}" for w in weights])
    assert max(weights) <= 0.55 and [r["params"] for r in rows["fp8"]] == [r["params"] for r in rows["bf16"]]


def test_commands_keep_fp8(pool, ds3_release, tmp_path, capsys):
    """import-hf --keep-fp8 then export-hf --fp8-blocks 128 give the release back bit for bit;
    megamoe-generate --keep-fp8 on the HF directory decodes the dequantised model's tokens, in
    one process and at PP=2 and TP=2 (two gloo ranks, rank 0 prints)."""
    from tests.test_generate_parallel import run_command
    from megamoe.commands.convert import main as convert
    from megamoe.commands.generate import main as generate

    fp8_dir, _ = ds3_release
    convert(["import-hf", str(fp8_dir), str(tmp_path / "mm"), "--keep-fp8"])
    convert(["export-hf", str(tmp_path / "mm"), str(tmp_path / "back"), "--fp8-blocks", "128"])
    release, exported = _files(fp8_dir), _files(tmp_path / "back")
    assert [n for n in release if not _bitwise(release[n], exported[n])] == []
    capsys.readouterr()
    tokens = []
    for extra in (["--keep-fp8"], []):
        generate([str(fp8_dir), "--ids", "5,9,13", "--max-new-tokens", "6", *extra])
        tokens.append(capsys.readouterr().out)
    assert tokens[0] == tokens[1] and tokens[0].strip()
    for layout in (["--pp", "2"], ["--tp", "2"]):
        got = pool(2).run(run_command, "generate", [str(fp8_dir), "--ids", "5,9,13", "--max-new-tokens", "6",
                                                    "--keep-fp8", *layout])
        assert got == [(0, tokens[0]), (0, "")], layout


# ---- FP8 experts in the tiered expert store ----------------------------------------------------

def _wide_deepseek_v3(dtype=torch.float32):
    """Experts of hidden 256 x 256 (two column blocks): the scales cost what they do at size."""
    from tests.test_convert_deepseek import randomized
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=256, intermediate_size=512,
                           moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                           v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                           topk_group=1, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return randomized(DeepseekV3ForCausalLM(cfg)).to(dtype)


def _loss_and_grads(model, ids) -> dict:
    from megamoe.lora import lora_parameters
    from megamoe.model.language_model import shift_labels

    loss = model(ids, labels=shift_labels(ids))
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in lora_parameters(model)}}


def test_expert_store_reads_fp8_experts(tmp_path):
    """Tiered experts from an FP8 release, both stores: the ``--keep-fp8`` converted checkpoint
    (e4m3 stacks + row scales) and the HF directory itself (``--experts-in-hf``: per-expert e4m3
    with 128x128 block scales). Each brings the routed experts in dequantised: the loss and every
    LoRA gradient (adapters on the experts too) equal the dequantised resident model's (fp32,
    rel 1e-5), at most 0.55x of the experts' bf16 bytes are read from the files, and an e4m3 store
    under a model whose fp8_base does not list its experts is one line naming the file."""
    from megamoe.core.config import ExpertStoreConfig
    from megamoe.core.errors import CheckpointError
    from megamoe.expert_store import open_expert_store
    from megamoe.inference.load import load_model
    from tests.fp8_utils import quantize_like_release
    from tests.numerics import rel_err

    _wide_deepseek_v3().save_pretrained(tmp_path / "hf")
    quantize_like_release(tmp_path / "hf", tmp_path / "fp8")
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(7))
    want = _loss_and_grads(_lora(from_hf(tmp_path / "fp8").train()), ids)
    stores = {"converted": import_hf(tmp_path / "fp8", tmp_path / "keep", keep_fp8=True, progress=False),
              "hf": import_hf(tmp_path / "fp8", tmp_path / "in_hf", experts=False, progress=False)}
    for kind, ckpt in stores.items():
        store_cfg = ExpertStoreConfig(budget_mib=2, prefetch=False)  # one expert per call, one cached
        model = _lora(load_model(ckpt, expert_store=store_cfg).train())
        got = _loss_and_grads(model, ids)
        errs = {n: rel_err(got[n], w) for n, w in want.items()}
        assert max(errs.values()) <= REL, (kind, {n: e for n, e in errs.items() if e > REL})
        store = model.expert_store
        layer = next(iter(store.layers.values()))
        bf16 = store.cache.stats["misses"] * layer.expert_bytes() // 2  # the model runs in fp32
        ratio = store.disk.read_bytes / bf16
        print(f"{kind} store: {store.disk.read_bytes} bytes read for {store.cache.stats['misses']} experts, "
              f"{ratio:.3f}x of bf16")
        assert store.cache.stats["misses"] >= 4 and ratio <= 0.55
        if kind == "converted":
            for m in store.layers.values():
                m.fp8_block = None  # as if the model's fp8_base did not list them
            with pytest.raises(CheckpointError, match=r"gate_up_weight is stored as torch.float8_e4m3fn.*fp8_base"):
                open_expert_store([model], model.groups, ckpt)
        store.close()


def test_finetune_command_on_an_fp8_base(tmp_path):
    """megamoe-finetune from an ``import-hf --keep-fp8`` checkpoint, resident and with the routed
    experts in the expert store, follows the run from the dequantised import: the loss at every
    step (TensorBoard's train/loss) within 1e-5, and the LoRA line counts the same parameters
    (the FP8 scales are not parameters)."""
    import contextlib
    import io

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from megamoe.commands import finetune
    from tests.test_convert_deepseek import SHAPE, randomized

    cfg = DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1, **{**SHAPE, "vocab_size": 264})  # byte ids
    fp8_dir, _ = fp8_checkpoint(randomized(DeepseekV3ForCausalLM(cfg)), tmp_path)
    keep = import_hf(fp8_dir, tmp_path / "keep", keep_fp8=True, progress=False)
    plain = import_hf(fp8_dir, tmp_path / "plain", progress=False)
    tiered = ["model.moe.expert_store.budget_mib=0.05", "model.moe.expert_store.prefetch=false"]
    runs = {}
    for name, ckpt, extra in (("dequantised", plain, []), ("fp8", keep, []), ("fp8 tiered", keep, tiered)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            finetune.main(["--config", "tiny_moe_lora", f"checkpoint.load={ckpt}", "data.kind=synthetic",
                           "data.seq_len=16", "train.steps=4", "train.micro_batch_size=2", "train.global_batch_size=2",
                           f"checkpoint.dir={tmp_path / name.replace(' ', '_')}", "logging.progress=false",
                           "logging.interval=1", *extra])
        acc = EventAccumulator(str(tmp_path / name.replace(" ", "_") / "tb"), size_guidance={"scalars": 0})
        acc.Reload()
        lora_line = next(x for x in out.getvalue().splitlines() if x.startswith("LoRA:"))
        runs[name] = (lora_line, [e.value for e in acc.Scalars("train/loss")])
    want_line, want = runs.pop("dequantised")
    assert len(want) == 4
    for name, (line, losses) in runs.items():
        assert line == want_line and max(abs(a - b) for a, b in zip(losses, want)) <= LOSS_TOL, name
