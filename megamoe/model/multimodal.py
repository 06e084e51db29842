"""Multimodal model assembly: where the vision tower meets the language model.

``MultimodalModel`` is a ``LanguageModel`` (same parameter names: ``embedding``, ``layers.*``,
``final_norm``, ``output_layer``) plus ``vision`` (``vision.encoder.*``, ``vision.projector.*``).
Images enter as a flat list in order of appearance over the batch (sample 0's images, then
sample 1's, ...), each a preprocessed ``[3, H, W]`` tensor (``model.vision.preprocessor()``).
Image ``i`` occupies ``vision.num_tokens(H_i, W_i)`` consecutive placeholder tokens
(``model.vision.image_token_id``) in ``input_ids``; their embeddings are replaced by the
projected image tokens. Any mismatch (counts, an image split across samples, stray
placeholders) is a one-line ``ImageError``.

Positions: with ``model.attention.mrope_section`` set (Qwen3.5's interleaved M-RoPE) they
are ``[3, b, s]`` (t, h, w) as in HF's ``get_rope_index``: text advances all three by one per
token; an image on an (gh, gw) token grid starting at position c gets t = c, h = c + row,
w = c + col, and the text after it continues at c + max(gh, gw). Otherwise positions are
plain ``0..s-1``. Under a decode cache the offset ``max position + 1 - s`` is kept in
``cache.layer("mrope")`` for the tokens that follow.

With ``model.vision.deepstack_layers`` (Qwen3-VL) each image token also brings one vector per
listed encoder block, added to the hidden states at the image tokens after LM layers 0, 1, ...
(``merge_images`` returns them, ``run_layers(after=...)`` adds them).

Shapes: input_ids [b, s]; hidden [b, s, h] ([b, s/tp, h] under SP); logits [b, s, V].
"""
from __future__ import annotations

from typing import Sequence

import torch

from megamoe.core.config import ModelConfig
from megamoe.core.errors import ConfigError
from megamoe.core.dtypes import DTYPES
from megamoe.model.language_model import LanguageModel
from megamoe.parallel import comm
from megamoe.parallel.context import split_for_cp
from megamoe.parallel.groups import ParallelGroups
from megamoe.layers.spec import ForwardInfo
from megamoe.vision.preprocess import ImageError
from megamoe.vision.tower import VisionTower


def image_spans(input_ids: torch.Tensor, token_id: int, counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(sample, start, length) of each image's placeholder run, images in order.

    Runs of consecutive placeholders are consumed image by image (two images may touch).
    """
    is_img = (input_ids == token_id).to(torch.int8)
    edges = torch.diff(is_img, dim=1, prepend=is_img.new_zeros(is_img.size(0), 1),
                       append=is_img.new_zeros(is_img.size(0), 1))
    starts, ends = (edges == 1).nonzero().tolist(), (edges == -1).nonzero().tolist()
    spans, k = [], 0
    for (b, start), (_, end) in zip(starts, ends):
        t = start
        while t < end:
            if k >= len(counts):
                raise ImageError(f"input_ids[{b}, {t}] is an image placeholder (id {token_id}) beyond the "
                                 f"{len(counts)} image(s) given ({int(is_img.sum())} placeholders, "
                                 f"{sum(counts)} image tokens)")
            if t + counts[k] > end:
                raise ImageError(f"image {k} needs {counts[k]} consecutive placeholders (id {token_id}) at "
                                 f"input_ids[{b}, {t}], found {end - t}")
            spans.append((b, t, counts[k]))
            t += counts[k]
            k += 1
    if k != len(counts):
        raise ImageError(f"{len(counts)} image(s) given but input_ids hold placeholders (id {token_id}) "
                         f"for {k}: {int(is_img.sum())} placeholders, {sum(counts)} image tokens")
    return spans


def local_images(spans, shard=None) -> list[int]:
    """Indices of the images with a placeholder token in this rank's CP chunks (all without CP)."""
    if shard is None or shard.size == 1:
        return list(range(len(spans)))
    bounds = shard.chunk_bounds()
    return [i for i, (_, start, n) in enumerate(spans)
            if any(start < end and lo < start + n for lo, end in bounds)]


def token_slots(shape, spans, device=None) -> torch.Tensor:
    """[b, S] long: for each placeholder of the given image spans, its row in those images' tokens
    concatenated in order; -1 elsewhere."""
    slot = torch.full(shape, -1, dtype=torch.long, device=device)
    offset = 0
    for b, start, n in spans:
        slot[b, start:start + n] = torch.arange(offset, offset + n, device=device)
        offset += n
    return slot


def mrope_positions(input_ids: torch.Tensor, spans, grids) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, b, s] (t, h, w) and delta [b] = max position + 1 - s.

    ``spans``: (sample, start, length) per image (``image_spans``); ``grids``: its (gh, gw)
    token grid in the language model.
    """
    b, s = input_ids.shape
    dev = input_ids.device
    pos = torch.empty(3, b, s, dtype=torch.long, device=dev)
    per_sample: list[list] = [[] for _ in range(b)]
    for (row, start, n), grid in zip(spans, grids):
        per_sample[row].append((start, n, grid))
    for row, items in enumerate(per_sample):
        cur, t = 0, 0
        for start, n, (gh, gw) in items + [(s, 0, (0, 0))]:
            pos[:, row, t:start] = torch.arange(cur, cur + start - t, device=dev)
            cur += start - t
            if n:
                pos[0, row, start:start + n] = cur
                pos[1, row, start:start + n] = cur + torch.arange(gh, device=dev).repeat_interleave(gw)
                pos[2, row, start:start + n] = cur + torch.arange(gw, device=dev).repeat(gh)
                cur += max(gh, gw)
            t = start + n
    delta = pos.amax(dim=(0, 2)) + 1 - s
    return pos, delta


class MultimodalModel(LanguageModel):
    """A LanguageModel whose first stage also holds a VisionTower (``cfg.vision``).

    ``vision_split_group``: the group the tower splits images over in ``split`` mode (default:
    this rank's TP group, the ranks that share a batch).
    """

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups | None = None, *,
                 sequence_parallel: bool = False, layer_ids: Sequence[int] | None = None,
                 pre_process: bool = True, post_process: bool = True, device=None, vision_split_group=None,
                 fp8: str | None = None):
        if cfg.vision is None:
            raise ConfigError("model.vision is not set: a multimodal model needs a vision section")
        super().__init__(cfg, groups, sequence_parallel=sequence_parallel, layer_ids=layer_ids,
                         pre_process=pre_process, post_process=post_process, device=device, fp8=fp8)
        self.image_token_id = cfg.vision.image_token_id
        self.mrope = cfg.attention.mrope_section is not None
        self.vision = None
        if pre_process:
            split = vision_split_group if vision_split_group is not None else self.groups.tp
            self.vision = VisionTower(cfg.vision, cfg.hidden_size, split_group=split, tp_group=self.groups.tp,
                                      init_std=cfg.init_std,
                                      dtype=DTYPES[cfg.params_dtype], device=device)
            self._check_deepstack(cfg)

    def _check_deepstack(self, cfg: ModelConfig) -> None:
        """Deepstack features join the residual stream after LM layers 0..L-1: they must be on the
        stage that holds the tower, and the stream must be the plain one."""
        levels = len(cfg.vision.deepstack_layers)
        if levels and not all(str(i) in self.layers for i in range(levels)):
            raise ConfigError(f"model.vision.deepstack_layers: the first pipeline stage must hold LM layers "
                              f"0..{levels - 1} (its deepstack features are added after them)")
        if levels and cfg.hyper_connections is not None:
            raise ConfigError("model.vision.deepstack_layers cannot be combined with model.hyper_connections")

    # ---- pieces -------------------------------------------------------------------------

    def merge_images(self, hidden: torch.Tensor, input_ids: torch.Tensor, images: list, spans,
                     shard=None) -> tuple[torch.Tensor, dict]:
        """Replace placeholder embeddings by image tokens. input_ids [b, S] (full sequence), ``spans``
        (``image_spans``), hidden [b, s(/tp), h] (this rank's CP chunks, ``shard``, cut over TP
        under SP). Under CP a rank encodes only the images with a placeholder in its chunks (an
        image across a chunk border is encoded by both ranks, each keeping its tokens): the others'
        tokens would not reach its hidden states, and their gradient here would be zero.
        Returns the hidden states and, with deepstack, {LM layer i: [b, s(/tp), h] level-i features
        at the image tokens, zeros elsewhere} (``run_layers``' ``after``)."""
        needed = local_images(spans, shard)
        tokens = self.vision([images[i] for i in needed])                    # [sum of their n_i, h]
        slot = token_slots(input_ids.shape, [spans[i] for i in needed], input_ids.device)  # [b, S]
        slot = split_for_cp(shard, slot)                                     # [b, s]: this rank's chunks
        mask = slot >= 0
        # one zero row after the tokens for the text positions (never selected by the mask): an image-free
        # rank still reads the tower's (empty, graph-keeping) output
        tokens = torch.cat([tokens.to(hidden.dtype), tokens.new_zeros(1, tokens.size(-1)).to(hidden.dtype)])
        img = tokens.index_select(0, slot.masked_fill(~mask, tokens.size(0) - 1).flatten()).view(*slot.shape, -1)
        if self.ctx.sp:  # keep this rank's sequence shard; backward gathers the full gradient
            img = comm.scatter_to(img, 1, self.groups.tp)
            mask = mask.chunk(self.groups.tp_size, dim=1)[self.groups.tp_rank]
        h = hidden.size(-1)
        deepstack = {i: img[..., h * (i + 1): h * (i + 2)] for i in range(img.size(-1) // h - 1)}  # 0 at text
        return torch.where(mask.unsqueeze(-1), img[..., :h], hidden), deepstack

    def positions_for(self, input_ids: torch.Tensor, spans, grids, cache=None) -> torch.Tensor:
        """[3, b, s] M-RoPE positions (first forward) or [b, s] (text, or decode steps)."""
        if not self.mrope:
            return self.default_positions(input_ids, None, cache)
        if cache is not None and cache.seen > 0:
            if spans:
                raise ImageError("images can only be given in the first forward of a decode cache")
            delta = cache.layer("mrope").get("delta")
            pos = self.default_positions(input_ids, None, cache)
            return pos if delta is None else pos + delta.unsqueeze(1)
        pos, delta = mrope_positions(input_ids, spans, grids)
        if cache is not None:
            cache.layer("mrope")["delta"] = delta
        return pos

    def embed_multimodal(self, input_ids: torch.Tensor, images=None, positions: torch.Tensor | None = None,
                         cache=None, shard=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(hidden [b, s(/tp), h] of this rank's CP chunks with image tokens merged, positions of
        the full sequence, deepstack additions as ``merge_images``)."""
        images = [] if images is None else list(images)
        sizes = [tuple(img.shape[-2:]) for img in images]
        spans = image_spans(input_ids, self.image_token_id, [self.vision.num_tokens(*hw) for hw in sizes])
        hidden, deepstack = self.merge_images(self.embed(split_for_cp(shard, input_ids)), input_ids, images, spans,
                                              shard)
        if positions is None:
            positions = self.positions_for(input_ids, spans, [self.vision.lm_grid(*hw) for hw in sizes], cache)
        return hidden, positions, deepstack

    # ---- forward ------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None = None, images=None, *, labels: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """Logits [b, s, V] (labels None), the mean loss (labels given) or, on a stage without the
        output layer, hidden states. Later pipeline stages take ``hidden`` and the ``positions``
        the first stage used."""
        out = self.forward_stage(input_ids if self.pre_process else hidden, positions=positions, cache=cache,
                                 images=images)
        if not self.post_process:
            return out
        return self.gather_logits(out) if labels is None else self.loss(out, labels)

    def forward_stage(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                      images=None, documents: torch.Tensor | None = None,
                      token_ids: torch.Tensor | None = None, mtp=None) -> torch.Tensor:
        """One pipeline stage (see ``LanguageModel.forward_stage``); the first stage also takes
        the batch's ``images``. Placeholders without images are an error, never ignored."""
        ids, hidden = (x, None) if self.pre_process else (None, x)
        shard = self.sequence_shard(self.full_length(ids, hidden, cache), cache)
        deepstack = None
        if self.pre_process:
            hidden, positions, deepstack = self.embed_multimodal(x, images, positions, cache, shard)
        elif positions is None:
            positions = self.default_positions(None, hidden, cache)
        token_ids = x if self.pre_process else token_ids
        info = ForwardInfo(positions=split_for_cp(shard, positions, dim=-1), cache=cache, cp=shard, documents=documents,
                           token_ids=split_for_cp(shard, token_ids))
        hidden = self.run_layers(hidden, info, after=deepstack)
        if cache is not None:  # every pipeline stage keeps its own cache
            cache.advance(positions.size(-1))
        return self.head(hidden, info, mtp) if self.post_process else hidden


# ---- addressing vision and language parameters separately -----------------------------------

PART_PREFIXES = {"vision_encoder": ("vision.encoder.",),
                 "vision_projector": ("vision.projector.", "vision.deepstack.")}  # deepstack mergers project too


def parameter_part(name: str) -> str:
    """'vision_encoder', 'vision_projector' or 'language' for a parameter name."""
    return next((part for part, prefixes in PART_PREFIXES.items() if name.startswith(prefixes)), "language")


def set_trainable(model: MultimodalModel, *, language: bool = True, vision_encoder: bool = True,
                  vision_projector: bool = True) -> None:
    """Freeze or unfreeze each part (requires_grad)."""
    wanted = {"language": language, "vision_encoder": vision_encoder, "vision_projector": vision_projector}
    for name, p in model.named_parameters():
        p.requires_grad_(wanted[parameter_part(name)])


def param_groups(model: MultimodalModel, lr: float, weight_decay: float = 0.0) -> list[dict]:
    """Optimizer parameter groups per part (trainable parameters only); the encoder's learning
    rate is ``lr * model.vision.lr_scale``."""
    parts: dict[str, list] = {"language": [], "vision_encoder": [], "vision_projector": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            parts[parameter_part(name)].append(p)
    scale = model.config.vision.lr_scale
    return [{"name": part, "params": params, "lr": lr * (scale if part == "vision_encoder" else 1.0),
             "weight_decay": weight_decay} for part, params in parts.items() if params]
