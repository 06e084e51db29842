"""The vision tower: timm encoder + projector, with its own parallel placement.

``VisionTower(cfg, out_dim)`` maps a list of preprocessed images (each ``[3, H_i, W_i]``,
sizes may differ) to language-model tokens ``[sum_i n_i, out_dim]`` in image order, where
``n_i = num_tokens(H_i, W_i)``. Images of equal size are encoded as one batch. With
``cfg.deepstack_layers`` (Qwen3-VL) each token also carries one ``out_dim`` vector per listed
encoder block (that block's output through its own merger): ``[sum_i n_i, token_dim]`` with
``token_dim = out_dim * (1 + len(deepstack_layers))``.

Parallel placement (``cfg.parallel.mode``), over ``split_group`` (the ranks that share a
batch, i.e. the language model's TP group):

- ``replicated``: every rank encodes every image; gradients are identical on all ranks.
- ``split``: images are assigned to ranks (largest first, to the least-loaded rank), each rank
  encodes and projects its own, and the tokens are all-gathered (padded to the largest
  share). Each rank's gradient covers its own images, so every tower parameter is marked
  ``mark_tp_partial_grad`` and ``megamoe.model.weights.finalize_grads`` sums it over the group.

With ``cfg.parallel.tp > 1`` the encoder's attention and MLP blocks are split over
``tp_group`` (the language model's TP group) instead, see ``megamoe.vision.tensor_parallel``.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.core.config import VisionConfig
from megamoe.core.errors import ConfigError
from megamoe.parallel import comm
from megamoe.parallel.groups import group_rank, group_size
from megamoe.parallel.sharding import mark_tp_partial_grad
from megamoe.vision.encoder import TimmEncoder
from megamoe.vision.preprocess import ImagePreprocessor
from megamoe.vision.projector import PatchMerger, build_projector
from megamoe.vision.tensor_parallel import shard_encoder


def assign_images(token_counts: list[int], ranks: int) -> list[list[int]]:
    """Image indices per rank: largest first onto the least-loaded rank (ties: lower index)."""
    load, owned = [0] * ranks, [[] for _ in range(ranks)]
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owned[r].append(i)
        load[r] += token_counts[i]
    return [sorted(o) for o in owned]


class VisionTower(nn.Module):
    """images: list of [3, H, W] -> tokens [N, out_dim]; see the module docstring."""

    def __init__(self, cfg: VisionConfig, out_dim: int, *, split_group=None, tp_group=None, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32, device=None, path: str = "model.vision"):
        super().__init__()
        self.cfg, self.out_dim, self.path = cfg, out_dim, path
        self.encoder = TimmEncoder(cfg, path)
        self.projector = build_projector(cfg, self.encoder.dim, out_dim, init_std)
        self.taps = list(cfg.deepstack_layers)
        self.deepstack = nn.ModuleList([
            PatchMerger(self.encoder.dim, out_dim, cfg.merge_size, init_std, eps=cfg.projector_norm_eps,
                        norm_after_merge=True) for _ in self.taps]) if self.taps else None
        self.token_dim = out_dim * (1 + len(self.taps))  # [main | deepstack 0 | deepstack 1 ...]
        on_meta = next(self.encoder.parameters()).is_meta
        if cfg.weights and not on_meta:
            self.encoder.load(cfg)
        self._adopt_native_merger(loaded=bool(cfg.weights) and not on_meta)
        if cfg.parallel.tp > 1:  # after loading: the loaded weights are what is split
            shard_encoder(self.encoder.model, tp_group, path)
        self.encoder.mark_init_rules()
        if cfg.freeze:
            self.encoder.requires_grad_(False)
        self.split_group = split_group if cfg.parallel.mode == "split" else None
        if group_size(self.split_group) > 1:
            for p in self.parameters():
                mark_tp_partial_grad(p)
        self.merge_size = self.projector.merge_size
        self.patch_multiple = self.encoder.reduction * self.merge_size
        self.to(dtype=dtype, device=device)

    def _adopt_native_merger(self, loaded: bool) -> None:
        """Move the weights of a timm-native merger (qwen3_vit_*_enc) into the projector."""
        native = self.encoder.native_merger
        self.encoder.native_merger = None
        if native is None or not loaded:
            return
        theirs = native.state_dict()
        if isinstance(self.projector, PatchMerger) and {k: v.shape for k, v in theirs.items()} == \
                {k: v.shape for k, v in self.projector.state_dict().items()}:
            with torch.no_grad():
                self.projector.load_state_dict(theirs, strict=True)
            return
        fc2 = theirs.get("fc2.weight")
        raise ConfigError(f"{self.path}.projector={self.cfg.projector!r} does not fit the checkpoint's merger "
                          f"(merge {getattr(native, 'merge_size', '?')}, out "
                          f"{None if fc2 is None else fc2.shape[0]}); use projector=merger with the LM hidden "
                          f"size {self.out_dim} and encoder_args.out_features={self.out_dim}")

    def train(self, mode: bool = True):
        super().train(mode)
        if self.cfg.freeze:
            self.encoder.eval()  # a frozen encoder keeps eval behaviour (dropout, norms)
        return self

    # ---- sizes --------------------------------------------------------------------------

    def lm_grid(self, height: int, width: int) -> tuple[int, int]:
        """Token grid (rows, cols) one height x width image becomes in the language model."""
        gh, gw = self.encoder.grid(height, width)
        return gh // self.merge_size, gw // self.merge_size

    def num_tokens(self, height: int, width: int) -> int:
        gh, gw = self.lm_grid(height, width)
        return gh * gw

    def image_tokens(self, image) -> int:
        """Placeholders a raw image (anything with ``height``/``width``, e.g. a PIL image) needs
        once preprocessed: the ``image_tokens`` callable of ``megamoe.data.ImageCaptionDataset``."""
        if getattr(self, "_prep", None) is None:
            self._prep = self.preprocessor()
        return self.num_tokens(*self._prep.target_size(image.height, image.width))

    def preprocessor(self) -> ImagePreprocessor:
        """Bounded preprocessing matching this encoder (timm data config) and projector."""
        dc = self.encoder.data_config
        return ImagePreprocessor(self.cfg.bounds, patch_multiple=self.patch_multiple, mean=dc["mean"],
                                 std=dc["std"], interpolation=dc.get("interpolation", "bicubic"),
                                 fixed_size=self.encoder.fixed_size, dynamic=self.encoder.dynamic,
                                 path=f"{self.path}.bounds")

    # ---- forward ------------------------------------------------------------------------

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Same-size batch [b, 3, H, W] -> [b, n, token_dim] (out_dim, or with deepstack the main
        tokens then each deepstack level's, concatenated on the last dimension)."""
        p = next(self.encoder.parameters())
        images = images.to(device=p.device, dtype=p.dtype)
        with torch.no_grad() if self.cfg.freeze else nullcontext():  # the projector and mergers train
            if self.taps:
                feats, grid, kept = self.encoder.forward_with_taps(images, self.taps)
            else:
                (feats, grid), kept = self.encoder(images), []
        levels = [merger(x, grid)[0] for merger, x in zip(self.deepstack or [], kept)]
        return torch.cat([self.projector(feats, grid)[0], *levels], dim=-1)

    def _encode_list(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        by_size: dict[tuple, list[int]] = {}
        for j, img in enumerate(images):
            by_size.setdefault(tuple(img.shape[-2:]), []).append(j)
        out: list = [None] * len(images)
        for idx in by_size.values():
            tokens = self.encode(torch.stack([images[j] for j in idx]))
            for row, j in enumerate(idx):
                out[j] = tokens[row]
        return out

    def forward(self, images) -> torch.Tensor:
        images = list(images)
        for i, img in enumerate(images):
            if img.dim() != 3 or img.size(0) != 3:
                raise ValueError(f"images[{i}] has shape {list(img.shape)}, expected [3, H, W]")
        if group_size(self.split_group) > 1:
            return self._forward_split(images)
        if not images:
            return self._empty()
        return torch.cat(self._encode_list(images), dim=0)

    def _empty(self) -> torch.Tensor:
        """[0, out_dim] tokens. Under autograd a zero term keeps the trainable parameters in the
        graph, so every rank ends backward with (zero) gradients and collectives over them
        (split-mode sums, data-parallel averages) stay matched across ranks."""
        p = next(self.parameters())
        out = p.new_zeros(0, self.token_dim)
        trainable = [q.sum() for q in self.parameters() if q.requires_grad]
        if trainable and torch.is_grad_enabled():
            out = out + 0.0 * sum(trainable)
        return out

    def _forward_split(self, images: list[torch.Tensor]) -> torch.Tensor:
        group = self.split_group
        counts = [self.num_tokens(*img.shape[-2:]) for img in images]
        owned = assign_images(counts, group_size(group))
        share = [sum(counts[i] for i in o) for o in owned]
        width = max(share, default=0)
        if width == 0:
            return self._empty()
        mine = owned[group_rank(group)]
        local = torch.cat(self._encode_list([images[i] for i in mine]), dim=0) if mine else self._empty()
        gathered = comm.gather_from(F.pad(local, (0, 0, 0, width - local.size(0))), 0, group)
        pieces: list = [None] * len(images)
        for r, own in enumerate(owned):
            offset = r * width
            for i in own:
                pieces[i] = gathered[offset: offset + counts[i]]
                offset += counts[i]
        return torch.cat(pieces, dim=0)
