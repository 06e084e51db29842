"""megamoe.layers.mixers: the token mixers, one per layout letter (or two)."""
