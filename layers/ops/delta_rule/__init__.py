"""The gated delta rule: token by token (naive), in chunks with per-channel decay (chunk), with one decay per head (chunk_gated)."""
