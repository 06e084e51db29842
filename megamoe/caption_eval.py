"""Held-out caption accuracy of an exported vision-language model, decoded by ``transformers``.

The quickstart's measure of whether training worked. ``num_images`` image-caption pairs come
from the generator the training recipe used (``data.generator``, e.g. the shapes of
``megamoe.data.shapes``) with a seed training never used (pair i of seed s is drawn from
``rng([s, i])``; training drew from ``data.seed``), so every image is new to the model. The
exported HF checkpoint, loaded by ``transformers``, captions them by batched greedy decoding,
and each generated caption is compared with the true one:

- ``exact``: the generated caption equals the true caption;
- ``colour`` / ``shape`` / ``place``: over the shapes the true captions name, the fraction
  whose field the generated caption has right at the same position (``shapes.parse_caption``;
  a shape the generated caption leaves out is wrong in every field).

Pixels come from megamoe's preprocessing for the tower the checkpoint describes (what training
fed the model; the export carries no HF image processor): ``[3, H, W]`` normalised, then HF's
``pixel_values [patches, C*T*p*p]`` + ``image_grid_thw [images, 3]``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megamoe.data.shapes import FIELDS, parse_caption
from megamoe.errors import ConfigError


@dataclass
class CaptionScore:
    truths: list[str]
    generated: list[str]
    seed: int
    fields: dict[str, float] = field(default_factory=dict)  # colour/shape/place accuracy in [0, 1]

    @property
    def correct(self) -> int:
        return sum(g == t for g, t in zip(self.generated, self.truths))

    @property
    def exact(self) -> float:
        return self.correct / len(self.truths)

    def metrics(self) -> dict[str, float]:
        """What goes to TensorBoard (``eval/<key>``) and metrics.jsonl."""
        return {"caption_exact": self.exact, **{f"caption_{k}": v for k, v in self.fields.items()},
                "caption_images": len(self.truths), "caption_seed": self.seed}

    def report(self) -> str:
        """The accuracy line, then one right and one wrong example (when there is one)."""
        parts = ", ".join(f"{k} {100 * v:.1f}%" for k, v in self.fields.items())
        lines = [f"held-out caption accuracy: {self.correct}/{len(self.truths)} exact = {100 * self.exact:.1f}% "
                 f"({parts}; images drawn with seed {self.seed}, never seen in training)"]
        for label, want in (("right", True), ("wrong", False)):
            i = next((i for i, (g, t) in enumerate(zip(self.generated, self.truths)) if (g == t) == want), None)
            if i is not None:
                lines.append(f"  {label}: image {i}: true {self.truths[i]!r}, generated {self.generated[i]!r}")
        return "\n".join(lines)


def score_captions(generated: list[str], truths: list[str], seed: int) -> CaptionScore:
    right, total = dict.fromkeys(FIELDS, 0), 0
    for g, t in zip(generated, truths):
        got, want = parse_caption(g), parse_caption(t)
        total += len(want)
        for j, true_fields in enumerate(want):
            for name, value, guess in zip(FIELDS, true_fields, got[j] if j < len(got) else (None,) * 3):
                right[name] += value == guess
    return CaptionScore(list(truths), list(generated), seed, {k: v / max(total, 1) for k, v in right.items()})


def hf_pixel_inputs(hf_dir: str | Path):
    """image -> (pixel_values, image_grid_thw) as the checkpoint's tower preprocesses it, and the
    number of placeholder tokens it takes (the tower is built on the meta device: no weights)."""
    from megamoe.convert.hf_io import read_config
    from megamoe.vision.hf_qwen import images_to_pixel_values, qwen_vision_config
    from megamoe.vision.tower import VisionTower

    hf = read_config(hf_dir)
    if "vision_config" not in hf:
        raise ConfigError(f"{hf_dir}/config.json has no vision_config: not a vision-language checkpoint")
    cfg = qwen_vision_config(hf)
    with torch.device("meta"):
        tower = VisionTower(cfg, hf["text_config"]["hidden_size"])
    prep, temporal = tower.preprocessor(), hf["vision_config"].get("temporal_patch_size", 2)

    def convert(image):
        pixels = prep(image)[None]  # [1, 3, H, W]
        pv, grid = images_to_pixel_values(pixels, cfg.encoder_args["patch_size"], tower.merge_size, temporal)
        return pv, grid, tower.num_tokens(*pixels.shape[-2:])

    return convert, hf["image_token_id"]


@torch.no_grad()
def caption_images(hf_dir: str | Path, images: list, tokenizer, max_new_tokens: int = 80,
                   batch_size: int = 32, hf_model=None) -> list[str]:
    """Greedy captions of PIL ``images`` by the transformers model of ``hf_dir``, in batches of
    images of equal token count (so no prompt needs padding)."""
    from megamoe.convert.verify import load_hf_model

    model = hf_model if hf_model is not None else load_hf_model(hf_dir)
    convert, image_token = hf_pixel_inputs(hf_dir)
    inputs = [convert(img) for img in images]
    order = sorted(range(len(images)), key=lambda i: inputs[i][2])
    captions = [""] * len(images)
    while order:
        n = inputs[order[0]][2]
        batch = [i for i in order if inputs[i][2] == n][:batch_size]
        order = [i for i in order if i not in batch]
        ids = torch.full((len(batch), n), image_token)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             pixel_values=torch.cat([inputs[i][0] for i in batch]),
                             image_grid_thw=torch.cat([inputs[i][1] for i in batch]),
                             mm_token_type_ids=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                             suppress_tokens=[image_token])  # placeholders are not text (as megamoe's generate)
        for i, row in zip(batch, out[:, n:].tolist()):
            captions[i] = tokenizer.decode(row[:row.index(tokenizer.eos_id)] if tokenizer.eos_id in row else row)
    return captions


def held_out_pairs(recipe, num_images: int, seed: int) -> list:
    """``num_images`` pairs from the recipe's generator with ``seed`` (which must not be the
    training data's)."""
    from megamoe.data.loader import load_generator

    if recipe.data.generator is None:
        raise ConfigError("data.generator: the recipe trained on files; held-out pairs need a generator")
    if seed == recipe.data.seed:
        raise ConfigError(f"held-out seed {seed} is data.seed, the seed of the training pairs; pick another")
    return load_generator(recipe.data.generator)(num_samples=num_images, seed=seed)


def record(log_dir: str | Path, step: int, score: CaptionScore) -> None:
    """Append the accuracy to ``log_dir``'s metrics.jsonl and TensorBoard (``eval/...``) at ``step``."""
    from torch.utils.tensorboard import SummaryWriter

    metrics = score.metrics()
    with open(Path(log_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    with SummaryWriter(str(log_dir)) as writer:
        for key, value in metrics.items():
            if key not in ("caption_images", "caption_seed"):
                writer.add_scalar(f"eval/{key}", value, step)
