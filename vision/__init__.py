"""megamoe.vision: timm vision encoders, projectors/mergers and image preprocessing.

Imports the megamoe core only (never megamoe.layers); ``megamoe.model.multimodal`` joins a
``VisionTower`` to the language model.
"""
from megamoe.vision.encoder import TimmEncoder  # noqa: F401
from megamoe.vision.preprocess import ImageError, ImagePreprocessor, fit_size  # noqa: F401
from megamoe.vision.projector import MLPProjector, PatchMerger, build_projector  # noqa: F401
from megamoe.vision.tower import VisionTower, assign_images  # noqa: F401
