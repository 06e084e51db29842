"""DeepSeek-V4's compressed attention (letters W, C, H of ``megamoe.layers.mixers.compressed_attention``).

- ``pool``: complete blocks of a segment of tokens and their gated pooling into entries
  (``find_blocks``, ``pool_blocks``);
- ``naive``: the references: the HF-shaped compression of one document
  (``naive_compress``) and attention over the dense [query x (window key + entry)] scores
  (``naive_compressed_attention``);
- ``chunk``: the form layers run: query tiles, each scoring only the keys its window reaches
  and its selected (or visible) entries, recomputed in backward (``chunk_compressed_attention``).
"""
from megamoe.layers.ops.compressed_attention.chunk import chunk_compressed_attention
from megamoe.layers.ops.compressed_attention.naive import naive_compress, naive_compressed_attention
from megamoe.layers.ops.compressed_attention.pool import EMPTY, Blocks, Entries, find_blocks, pool_blocks

__all__ = ["EMPTY", "Blocks", "Entries", "chunk_compressed_attention", "find_blocks", "naive_compress",
           "naive_compressed_attention", "pool_blocks"]
