"""megamoe.inference (floor 6): decoding, in one process or at a parallel layout."""
