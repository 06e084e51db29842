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
``pixel_values [patches, C*T*p*p]`` + ``image_grid_thw [images, 3]``. The captions are the
transformers model's greedy decoding, found by checking megamoe's greedy decoding of the same
checkpoint against one full transformers forward (``confirm_greedy``, which says why not
``generate``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megamoe.data.shapes import FIELDS, parse_caption
from megamoe.core.errors import ConfigError


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
    """image -> (pixels [3, H, W], pixel_values, image_grid_thw, placeholder count) as the
    checkpoint's tower preprocesses it (the tower is built on the meta device: no weights)."""
    from megamoe.checkpoint.hf_io import read_config
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
        pixels = prep(image)
        pv, grid = images_to_pixel_values(pixels[None], cfg.encoder_args["patch_size"], tower.merge_size, temporal)
        return pixels, pv, grid, tower.num_tokens(*pixels.shape[-2:])

    return convert, hf["image_token_id"]


@torch.no_grad()
def caption_images(hf_dir: str | Path, images: list, tokenizer, max_new_tokens: int = 80, batch_size: int = 64,
                   hf_model=None) -> tuple[list[str], int]:
    """Greedy captions of PIL ``images`` by the transformers model of ``hf_dir`` (see
    ``confirm_greedy``), in batches of images of equal token count (no prompt needs padding);
    and how many of them transformers had to correct megamoe's draft on."""
    from megamoe.convert import from_hf
    from megamoe.diagnostics.verify import load_hf_model
    from megamoe.inference.generate import generate

    model = hf_model if hf_model is not None else load_hf_model(hf_dir)
    draft_model = from_hf(hf_dir).float().eval()
    convert, image_token = hf_pixel_inputs(hf_dir)
    inputs = [convert(img) for img in images]
    order = sorted(range(len(images)), key=lambda i: inputs[i][3])
    captions, corrected = [""] * len(images), 0
    while order:
        n = inputs[order[0]][3]
        batch = [i for i in order if inputs[i][3] == n][:batch_size]
        order = [i for i in order if i not in batch]
        ids = torch.full((len(batch), n), image_token)
        draft = generate(draft_model, ids, max_new_tokens, images=[inputs[i][0] for i in batch],
                         eos_token_id=tokenizer.eos_id)
        rows, fixed = confirm_greedy(model, draft, [inputs[i][1:3] for i in batch], image_token, tokenizer.eos_id,
                                     n, max_new_tokens)
        corrected += fixed
        for i, row in zip(batch, rows):
            captions[i] = decode_caption(tokenizer, row)
    return captions, corrected


def _hf_logits(model, ids: torch.Tensor, pixel_values: torch.Tensor, grid_thw: torch.Tensor, image_token: int):
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixel_values,
                   image_grid_thw=grid_thw, mm_token_type_ids=(ids == image_token).int()).logits
    logits[..., image_token] = float("-inf")  # placeholders are not text (as in megamoe's generate)
    return logits


def confirm_greedy(model, draft: torch.Tensor, pixels: list, image_token: int, eos: int, n: int,
                   max_new_tokens: int) -> tuple[list[list[int]], int]:
    """transformers' greedy continuation of each row's n image placeholders, from megamoe's
    greedy ``draft`` [b, n + t]: one full forward of the transformers model over the drafted
    rows gives its argmax after every prefix; a row whose drafted tokens (up to EOS) all equal
    those argmaxes is exactly transformers' greedy decoding. A row that differs (a near tie
    decided the other way by fp32 rounding) keeps the agreed prefix plus transformers' token
    and is finished by ``greedy``. Returns the new tokens per row and how many rows differed.

    Why not ``model.generate``: with transformers 5.25 on CPU, a Qwen3_5Moe checkpoint's cached
    decoding after an image-only prompt drifts from its own full forward (logits apart by up to
    ~0.7 from the second new token on, while the full forward matches megamoe's to 1e-5) and
    flips near-tied choices; and a full forward per new token costs minutes for 64 images.
    """
    pv, thw = torch.cat([p for p, _ in pixels]), torch.cat([g for _, g in pixels])
    best = _hf_logits(model, draft, pv, thw, image_token)[:, n - 1:-1].argmax(-1)  # [b, t]
    rows, fixed = [], 0
    for r, (drafted, want) in enumerate(zip(draft[:, n:].tolist(), best.tolist())):
        end = drafted.index(eos) + 1 if eos in drafted else len(drafted)
        j = next((j for j in range(end) if drafted[j] != want[j]), None)
        if j is None:
            rows.append(drafted[:end])
            continue
        fixed += 1
        prefix = torch.tensor([[image_token] * n + drafted[:j] + [want[j]]])
        rest = max_new_tokens - j - 1 if want[j] != eos else 0
        rows.append(greedy(model, prefix, *pixels[r], image_token, eos, rest)[0, n:].tolist())
    return rows, fixed


@torch.no_grad()
def greedy(model, ids: torch.Tensor, pixel_values: torch.Tensor, grid_thw: torch.Tensor, image_token: int,
           eos: int, max_new_tokens: int) -> torch.Tensor:
    """ids [b, s] -> [b, s + new]: each new token the argmax of a full forward of the
    transformers model over everything so far (finished rows continue with EOS)."""
    done = ids[:, -1] == eos
    for _ in range(max_new_tokens):
        if done.all():
            break
        nxt = torch.where(done, eos, _hf_logits(model, ids, pixel_values, grid_thw, image_token)[:, -1].argmax(-1))
        ids, done = torch.cat([ids, nxt[:, None]], 1), done | (nxt == eos)
    return ids


def decode_caption(tokenizer, ids: list[int]) -> str:
    """Text up to the first EOS; ids past the tokenizer's vocabulary (the model's embedding may
    be padded beyond it) become U+FFFD instead of failing the decode."""
    ids = ids[:ids.index(tokenizer.eos_id)] if tokenizer.eos_id in ids else ids
    text, run = [], []
    for t in ids + [None]:
        if t is not None and t < tokenizer.vocab_size:
            run.append(t)
            continue
        text.append(tokenizer.decode(run) + ("\ufffd" if t is not None else ""))
        run = []
    return "".join(text)


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
