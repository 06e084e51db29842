"""The decode cache: the state contract every mixer keeps its decoding state in (contiguous and paged)."""
