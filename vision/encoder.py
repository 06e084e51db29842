"""Any timm model as a patch-feature encoder, built offline.

``TimmEncoder(cfg)`` creates ``timm.create_model(cfg.encoder, pretrained=False, num_classes=0,
**cfg.encoder_args)`` (with ``dynamic_img_size=True`` where the model takes it), draws timm's
own initialisation under ``cfg.seed`` so every rank builds the same weights, optionally loads
a local checkpoint (``megamoe.vision.checkpoint``) and returns patch features::

    images [b, 3, H, W] -> features [b, gh*gw, d], grid (gh, gw)   (row-major patches)

ViT-style outputs ``[b, prefix + n, d]`` lose their prefix (class/register) tokens; NCHW
(convnets) and NHWC (Swin, Qwen3 ViT) maps are flattened. An encoder that ships its own
projector (timm's ``qwen3_vit_*_enc`` merger) keeps it in ``native_merger`` until the tower
adopts its weights; the encoder itself always returns raw patch features.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.core.config import VisionConfig
from megamoe.core.errors import ConfigError
from megamoe.parallel.sharding import KEEP, mark_init
from megamoe.vision.checkpoint import load_encoder_weights


def register_native_towers() -> None:
    """Towers timm lacks, written in timm's style in megamoe.vision, join timm's registry (on first
    use: importing timm's model zoo costs every process that never builds a tower)."""
    import megamoe.vision.glm_vit  # noqa: F401
    import megamoe.vision.kimi_vit  # noqa: F401
    import megamoe.vision.minimax_vit  # noqa: F401


def _create(cfg: VisionConfig, path: str):
    import timm

    register_native_towers()
    if not timm.is_model(cfg.encoder):
        raise ConfigError(f"{path}.encoder={cfg.encoder!r} is not a timm model (see timm.list_models())")
    kwargs = {"pretrained": False, "num_classes": 0, **cfg.encoder_args}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        try:
            return timm.create_model(cfg.encoder, dynamic_img_size=True, **kwargs), True
        except TypeError as e:
            if "dynamic_img_size" not in str(e):
                raise ConfigError(f"{path}.encoder_args={cfg.encoder_args} rejected by {cfg.encoder}: {e}") from None
        torch.manual_seed(cfg.seed)
        try:
            model = timm.create_model(cfg.encoder, **kwargs)
        except TypeError as e:
            raise ConfigError(f"{path}.encoder_args={cfg.encoder_args} rejected by {cfg.encoder}: {e}") from None
    if "dynamic_img_size" in cfg.encoder_args:  # the user's own choice
        return model, bool(cfg.encoder_args["dynamic_img_size"])
    return model, not model.pretrained_cfg.get("fixed_input_size", False)


class TimmEncoder(nn.Module):
    """images [b, 3, H, W] -> (features [b, gh*gw, d], (gh, gw))."""

    def __init__(self, cfg: VisionConfig, path: str = "model.vision"):
        super().__init__()
        model, self.dynamic = _create(cfg, path)
        self.name = cfg.encoder
        # a native projector (qwen3_vit_*_enc) is held aside: the tower decides what to do with it
        self.native_merger = getattr(model, "merger", None)
        if self.native_merger is not None:
            model.merger = None
        self.model = model
        self.dim = model.num_features
        self.num_prefix = getattr(model, "num_prefix_tokens", 0) or 0
        self.output_fmt = getattr(model, "output_fmt", "NCHW")
        self.reduction = self._reduction(model)
        self.data_config = self._data_config(model)
        self.fixed_size = self._fixed_size(model)
        if cfg.recompute:
            if not hasattr(model, "set_grad_checkpointing"):
                raise ConfigError(f"{path}.recompute=True is invalid: {cfg.encoder} has no gradient checkpointing")
            model.set_grad_checkpointing(True)

    # ---- facts about the encoder --------------------------------------------------------

    @staticmethod
    def _reduction(model) -> int:
        info = getattr(model, "feature_info", None)
        if isinstance(info, list) and info and "reduction" in info[-1]:
            return int(info[-1]["reduction"])
        return int(model.patch_embed.patch_size[0])

    @staticmethod
    def _data_config(model) -> dict:
        import timm.data

        return timm.data.resolve_model_data_config(model)

    def _fixed_size(self, model) -> tuple[int, int]:
        pe = getattr(model, "patch_embed", None)
        if pe is not None and getattr(pe, "img_size", None) is not None:
            return tuple(int(s) for s in pe.img_size)
        return tuple(int(s) for s in self.data_config["input_size"][1:])

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Patch grid for an input of height x width (a multiple of the reduction)."""
        return height // self.reduction, width // self.reduction

    # ---- weights ------------------------------------------------------------------------

    def load(self, cfg: VisionConfig) -> None:
        """Load ``cfg.weights`` strictly (the native merger, when present, is part of the load)."""
        native = self.native_merger is not None
        if native:
            self.model.merger = self.native_merger
        try:
            load_encoder_weights(self.model, cfg.weights, cfg.weights_prefix, cfg.weights_filter)
        finally:
            if native:
                self.model.merger = None

    def mark_init_rules(self) -> None:
        """``megamoe.model.weights.initialize`` keeps the encoder's weights as built or loaded (timm
        draws them under ``cfg.seed`` on every rank; split pieces were cut from those)."""
        for p in self.parameters():
            mark_init(p, KEEP)

    # ---- forward ------------------------------------------------------------------------

    def forward_with_taps(self, images: torch.Tensor, taps: list[int]):
        """(features [b, gh*gw, d], (gh, gw), [block ``t``'s output [b, gh*gw, d] for t in taps]):
        timm's ``forward_intermediates`` (Qwen3-VL's deepstack reads blocks 8, 16, 24)."""
        if not hasattr(self.model, "forward_intermediates"):
            raise ConfigError(f"model.vision.deepstack_layers: encoder {self.name} has no forward_intermediates")
        out, kept = self.model.forward_intermediates(images, indices=list(taps), output_fmt="NLC")
        feats, grid = self._flatten(out, *images.shape[-2:])
        return feats, grid, [k.reshape(feats.shape) for k in kept]

    def forward(self, images: torch.Tensor):
        return self._flatten(self.model.forward_features(images), *images.shape[-2:])

    def _flatten(self, out: torch.Tensor, h: int, w: int):
        if out.dim() == 4:
            if self.output_fmt == "NHWC":
                b, gh, gw, d = out.shape
                return out.reshape(b, gh * gw, d), (gh, gw)
            b, d, gh, gw = out.shape
            return out.flatten(2).transpose(1, 2), (gh, gw)
        feats = out[:, self.num_prefix:]
        gh, gw = self.grid(h, w)
        if feats.size(1) != gh * gw:
            raise ValueError(f"encoder {self.name} gave {feats.size(1)} patch tokens for a {h}x{w} image, "
                             f"expected {gh}x{gw} (image sides must be multiples of {self.reduction})")
        return feats, (gh, gw)
