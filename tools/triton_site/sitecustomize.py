"""Triton adjustments for megamoe's kernel checks, loaded at start-up by every Python process
that has this folder on ``PYTHONPATH`` (tools/gpu_check.sh and tools/fla_interpret.sh put it
there; nothing else does). Without triton in the environment it does nothing.

``MEGAMOE_AUTOTUNE_CONFIGS=N`` (N > 0): Triton's autotuner, and fla's ``CachedAutotuner`` built
on it, tries only the first N of a kernel's configs that survive its own pruning. N = 1 picks
a config without timing any: under the interpreter timing needs a GPU driver, and on a GPU a
cold autotune of every fla kernel in every process of the check would take minutes of a
15-minute loan. Unset or 0: Triton's own behaviour.

``TRITON_INTERPRET=1``: a ``for i in range(n)`` inside a kernel yields Triton tensors, as
compiled Triton's loops do, instead of the Python ints the interpreter gives: fla's chunked
kernels call ``i_t.to(tl.int64)`` on their loop variable (``chunk_fwd_kernel_h``,
``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` and their backwards), which stops the
interpreter with "'int' object has no attribute 'to'" otherwise; and each ``tl.dot`` checks its
operands against the shapes a compiled kernel takes on an H100 (the installed Triton's NVIDIA
backend's ``min_dot_size``: K >= 16 for 16-bit operands, 8 for fp32), which numpy alone would
multiply at any shape.
"""
import builtins
import os

try:
    import triton
except ImportError:  # nothing to adjust
    triton = None


def _limit_autotune(limit: int) -> None:
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def first_configs(self, kwargs, *args, **kw):
        return prune(self, kwargs, *args, **kw)[:limit]

    Autotuner.prune_configs = first_configs


def _tensor_loop_variables() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    def tensor_range(*bounds):
        ints = [int(b.handle.data.item()) if isinstance(b, tl.tensor) else int(b) for b in bounds]
        for i in builtins.range(*ints):
            yield interpreter._implicit_cvt(i)  # a scalar Triton tensor, as a compiled loop's

    run = interpreter.GridExecutor.__call__

    def run_with_tensor_range(self, *args, **kwargs):
        names = self.fn.__globals__  # the kernel's module: its ``range`` while the grid runs
        had, old = "range" in names, names.get("range")
        names["range"] = tensor_range
        try:
            return run(self, *args, **kwargs)
        finally:
            if had:
                names["range"] = old
            else:
                del names["range"]

    interpreter.GridExecutor.__call__ = run_with_tensor_range


def _compiled_dot_shapes() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import min_dot_size
    from triton.runtime import interpreter

    rule = min_dot_size(GPUTarget("cuda", 90, 32))
    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_checked(self, a, b, d, *args, **kwargs):
        m, n, k = rule(a.dtype, b.dtype)
        (rows, inner), cols = a.data.shape[-2:], b.data.shape[-1]
        if rows < m or inner < k or cols < n:
            raise AssertionError(f"tl.dot of {a.dtype} [{rows}, {inner}] x [{inner}, {cols}]: a compiled kernel "
                                 f"needs M >= {m}, N >= {n} and K >= {k}")
        return dot(self, a, b, d, *args, **kwargs)

    interpreter.InterpreterBuilder.create_dot = create_dot_checked


if triton is not None:
    _LIMIT = int(os.environ.get("MEGAMOE_AUTOTUNE_CONFIGS", "0") or 0)
    if _LIMIT > 0:
        _limit_autotune(_LIMIT)
    if os.environ.get("TRITON_INTERPRET") == "1":
        _tensor_loop_variables()
        _compiled_dot_shapes()
