"""FP8 GEMMs with row-wise scales through torch's scaled matmuls: linear roles and routed experts."""
