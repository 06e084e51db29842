"""megamoe.vision: timm vision encoders, projectors/mergers and image preprocessing."""
