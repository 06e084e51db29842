"""megamoe.layers: the model maths, one role per file. Importing registers every layout letter."""
from megamoe.layers import attention, mlp  # noqa: F401  (registration side effects)
from megamoe.layers import block_sparse, dsa, lightning, mla  # noqa: F401  (letters B, L, M, D, R, I)
from megamoe.layers import compressed_attention  # noqa: F401  (letters W, C, H)
from megamoe.layers.linear_attention import gdn, kda  # noqa: F401  (letters G, K)
from megamoe.layers import moe  # noqa: F401  (letter e)
from megamoe.layers.backends import CpuBackend, LocalBackend, get_backend, register_backend  # noqa: F401
from megamoe.layers.norm import RMSNorm  # noqa: F401
