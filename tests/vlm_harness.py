"""Vision-language families against transformers with images in the prompt (the tests of
kimi_k25, qwen3_vl_moe and glm5_next's tower):

- ``check_images``: the imported model's logits (fp32, max abs <= ATOL) and 16 greedy tokens
  equal transformers' for a prompt with images;
- ``grad_errors``: one cross-entropy backward through both models, every parameter's gradient
  compared in megamoe's names (HF gradients mapped through the family's own table);
- ``parallel_case`` / ``check_parallel_images``: a checkpoint imported for a parallel layout, run
  on gloo ranks with the images (``sequence_parallel`` in a layout is a run-time flag), against
  the single-process import (logits, loss and every gathered gradient);
- ``check_lora_steps``: 50 LoRA steps on the image prompt lower the loss, every router bitwise;
- ``prompts``: two prompts with images at given placeholder runs.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tests.conversion_harness import ATOL
from tests.numerics import max_abs, rel_err

GRAD_REL = 1e-5  # as tests/test_moe_hf.py and the parallel tests


@torch.no_grad()
def check_images(hf, ours, ids, images, hf_inputs, new_tokens: int = 16) -> float:
    from megamoe.inference.generate import generate

    want = hf(**hf_inputs).logits
    err = max_abs(ours(ids, images), want)
    assert err <= ATOL, err
    hf_tokens = hf.generate(**hf_inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(ours, ids, new_tokens, images=images), hf_tokens)
    return err


def targets_for(ids: torch.Tensor, vocab: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, ids.shape, generator=torch.Generator().manual_seed(seed))


def grad_errors(hf, ours, family: str, ids, images, hf_inputs, scale: dict | None = None) -> dict[str, float]:
    """Relative error of every trainable megamoe parameter's gradient against transformers' (mapped
    by the family table's ``to_mm``; ``scale``: megamoe name -> factor for a transform that is not
    orthogonal, e.g. a Conv3d over T identical frames summed into a Conv2d gives T x the gradient)."""
    from megamoe.convert.api import plan_entries
    from megamoe.convert.family import get_family

    hf.zero_grad(), ours.zero_grad()
    targets = targets_for(ids, hf.config.get_text_config().vocab_size)
    F.cross_entropy(hf(**hf_inputs).logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(ours(ids, images).flatten(0, 1), targets.flatten()).backward()
    theirs = dict(hf.named_parameters())
    available = set(theirs) | {n for n, _ in hf.named_buffers()}
    mine = dict(ours.named_parameters())
    entries = plan_entries(get_family(family), ours.config, hf.config.to_dict(), available)
    errs = {}
    for e in entries:
        if e.mm not in mine or not mine[e.mm].requires_grad:
            continue
        if mine[e.mm].grad is None:  # selection only (the DSA indexer): no gradient on either side
            errs[e.mm] = 0.0 if all(theirs[n].grad is None for n in e.hf) else 1.0
            continue
        grads = [theirs[n].grad if theirs[n].grad is not None else torch.zeros_like(theirs[n]) for n in e.hf]
        want = e.to_mm(grads) * (scale or {}).get(e.mm, 1.0)
        errs[e.mm] = rel_err(mine[e.mm].grad, want)
    assert len(errs) == sum(p.requires_grad for p in mine.values()), "a parameter has no HF counterpart"
    return errs


def parallel_case(root: str, layouts: dict, ids, images, targets, want_logits) -> dict:
    """On every rank: the single-process import (``root/single``) and each layout's import
    (``root/<name>``), forward with images and a cross-entropy backward; errors of the parallel
    run against the single one (logits, loss, every gathered gradient) and of its logits
    against transformers' (``want_logits``)."""
    from megamoe.core.config import ParallelConfig
    from megamoe.convert import build_model
    from megamoe.parallel.groups import build_groups
    from megamoe.parallel.sharding import gather_full
    from megamoe.core.config_io import config_from_dict
    from megamoe.checkpoint.dcp import load_checkpoint, read_meta
    from megamoe.model.weights import finalize_grads

    def run(path: Path, groups, sp: bool = False):
        model = build_model(config_from_dict(read_meta(path)["model"]), groups, sequence_parallel=sp).eval()
        load_checkpoint(path, model.groups, [model], load_rng=False)
        logits = model(ids, images)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        finalize_grads(model, model.groups)
        return model, logits, loss

    ref, ref_logits, ref_loss = run(Path(root) / "single", None)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out = {}
    for name, parallel in layouts.items():
        groups = build_groups(ParallelConfig(**parallel))
        model, logits, loss = run(Path(root) / name, groups, parallel.get("sequence_parallel", False))
        errs = {"logits": max_abs(logits, ref_logits), "hf logits": max_abs(logits, want_logits),
                "loss": abs(loss.item() - ref_loss.item())}
        for n, p in model.named_parameters():
            if ref_grads[n] is None:  # frozen (the router's selection bias): none on either side
                errs[f"grad {n}"] = 0.0 if p.grad is None else 1.0
            else:
                errs[f"grad {n}"] = rel_err(gather_full(p, groups, p.grad), ref_grads[n])
        out[name] = errs
    return out


def prompts(sizes, runs, token: int, length: int = 24, seed: int = 4):
    """(ids [2, length], images [3, h, w] per size): text ids in [3, 90), image ``i``'s
    placeholders at ``runs[i] = (row, start, stop)``."""
    gen = torch.Generator().manual_seed(seed)
    images = [torch.randn(3, h, w, generator=gen) for h, w in sizes]
    ids = torch.randint(3, 90, (2, length), generator=gen)
    for row, start, stop in runs:
        ids[row, start:stop] = token
    return ids, images


def check_parallel_images(hf, root: Path, pool, layouts: dict, ids, images, hf_inputs) -> None:
    """Import for one process and for each layout, run ``parallel_case`` on two ranks and assert:
    transformers' logits (ATOL), the single process's logits (1e-5), loss (1e-6), every gradient
    (GRAD_REL)."""
    from megamoe.convert import import_hf

    hf.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "single", progress=False)
    for name, parallel in layouts.items():
        sizes = {k: v for k, v in parallel.items() if k != "sequence_parallel"}  # a run-time flag
        import_hf(root / "hf", root / name, progress=False, **sizes)
    with torch.no_grad():
        want = hf(**hf_inputs).logits
    targets = targets_for(ids, hf.config.get_text_config().vocab_size)
    for rank, errs in enumerate(pool(2).run(parallel_case, str(root), layouts, ids, images, targets, want)):
        for name, e in errs.items():
            assert e["hf logits"] <= ATOL and e["logits"] <= 1e-5 and e["loss"] <= 1e-6, (rank, name, e)
            worst = max((k for k in e if k.startswith("grad")), key=e.get)
            assert e[worst] <= GRAD_REL, (rank, name, worst, e[worst])


def check_lora_steps(hf, root: Path, ids, images, steps: int = 50) -> list[float]:
    """``steps`` LoRA steps (rank 4 on every linear role and expert) on the image prompt: the loss
    halves and every router's weight and selection bias stays bitwise. Returns the losses."""
    from megamoe.convert import from_hf
    from megamoe.lora import LoRAConfig, apply_lora
    from megamoe.model.moe_controls import routers

    hf.save_pretrained(root / "hf")
    model = apply_lora(from_hf(root / "hf"), LoRAConfig(rank=4, alpha=8.0))
    frozen = {f"{r.layer_number}.{n}": t.detach().clone() for r in routers(model) for n, t in r.state_dict().items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and frozen and not any(p.requires_grad for n, p in model.named_parameters() if "router" in n)
    targets = targets_for(ids, model.config.vocab_size)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    model.train()
    for _ in range(steps):
        loss = F.cross_entropy(model(ids, images).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = {f"{r.layer_number}.{n}": t for r in routers(model) for n, t in r.state_dict().items()}
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert frozen.keys() == after.keys() and all(torch.equal(frozen[n], after[n]) for n in frozen)
    return losses
