"""megamoe.layers: the model maths, one role per file. Importing registers every layout letter."""
from megamoe.layers.mixers import attention  # noqa: F401  (registration side effects)
from megamoe.layers.mlp import dense as mlp  # noqa: F401  (registration side effects)
from megamoe.layers.mixers import block_sparse, dsa, lightning, mla  # noqa: F401  (letters B, L, M, D, R, I)
from megamoe.layers.mixers import compressed_attention  # noqa: F401  (letters W, C, H)
from megamoe.layers.mixers import gdn, kda  # noqa: F401  (letters G, K)
from megamoe.layers.mlp import moe  # noqa: F401  (letter e)
from megamoe.layers.backends import CpuBackend, LocalBackend, get_backend, register_backend  # noqa: F401
from megamoe.layers.norm import RMSNorm  # noqa: F401
