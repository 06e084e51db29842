"""Activation memory of a training step, as the planner counts it (megamoe/planning/plan.py).

What a rank keeps for backward is read off the implementation rather than a rule of thumb:
one layer of each distinct kind (mixer letter + MLP letter) is built under torch's
``FakeTensorMode`` (CPU tensors with shapes only: nothing allocated, and the CPU backend's
kernels are the ones that run) and runs one forward under ``saved_tensors_hooks``; the bytes
of the tensors autograd saves are summed, parameters excluded, each storage once. Only the
routed experts' dispatch depends on the data (which experts tokens pick); it is counted by
formula with balanced routing (``routed_bytes``). The CUDA backend's kernels are assumed to
keep the same tensors (flash attention: q, k, v, output and log-sum-exp, as on CPU).

Tensor parallelism: the traced layer is unsharded, so a part's figure is split as the layout
does: the residual-stream norms' saved input by TP under sequence parallelism (else whole);
a mixer's or MLP's own input (the norm output, which every column-parallel linear saves
after the SP all-gather, or as the replicated stream) whole; everything else inside a mixer
or MLP (heads, ffn columns) by TP. CP divides every token count, and a mixer's bytes are then
multiplied by its measured CP factor (``CP_MIXER_FACTORS``).
"""
from __future__ import annotations

import contextlib
import math

import torch

from megamoe.core.layout import MOE_LETTERS

PARTS = ("input_norm", "mixer", "pre_mlp_norm", "mlp")

# What a CP rank's mixer keeps for its S/CP tokens over what the same mixer keeps for S/CP tokens
# in one process (the trace), measured at CP=2 with tiny widths at 512 and 2048 tokens (the same
# at both; tests/test_cp_train.py re-measures A and G): the ring keeps its fp32 output and
# log-sum-exp and the gathered K/V travel (A); G's state-passing op keeps what it keeps in one
# process (1.00); K's widened run keeps its wider states and M_t^T q_t, and its convolution from
# the halo its pre-activation (K), Lightning exp(-s t) q_t (L); DSA's CP path keeps less than
# its single-process selection (D, I). The sliding window's halo (S) and MLA's checkpointed
# query tiles (M: 0.06-0.2, falling with the length) are left at 1.
CP_MIXER_FACTORS = {"A": 1.14, "G": 1.00, "K": 1.16, "L": 1.06, "D": 0.86, "I": 0.82}


def _trace(fn, args, params: set[int], scale: float) -> tuple[float, float]:
    """Run ``fn(*args)`` on fake tensors; (bytes saved of ``args[0]``'s storage, bytes of the rest).
    ``scale``: activation bytes per element over the meta model's (floating tensors only)."""
    seen: set[int] = set(params)
    own, rest = [0.0], [0.0]
    mine = id(args[0].untyped_storage())

    def pack(t):
        storage = t.untyped_storage()
        key = id(storage)
        if key not in seen:
            seen.add(key)
            size = storage.nbytes() * (scale if t.is_floating_point() else 1.0)
            (own if key == mine else rest)[0] += size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return own[0], rest[0]


def routed_bytes(moe_cfg, tokens: float, act: int, etp: int = 1) -> float:
    """Saved bytes of the routed experts for ``tokens`` tokens a rank routes (balanced routing:
    a rank's experts receive as many token copies as it sends): the input [n, h] is the part's
    own input (counted by the caller); the router's scores [n, E] (fp32); per copy the expert
    kernel's gate|up pre-activation [2f/etp] in the activation dtype and 32 bytes of routing
    bookkeeping (int64 index and permutation, fp32 weight). Fitted to nothing: these are the
    tensors ``grouped_gemm``'s kernels and the router save (tests/test_plan_measured.py)."""
    f, k = moe_cfg.moe_ffn_hidden_size, moe_cfg.top_k
    return tokens * (4 * moe_cfg.num_experts + k * (2 * f * act / etp + 32))


@contextlib.contextmanager
def _routed_stub(mlp):
    """The MoE's routed part replaced by a copy that saves nothing (its bytes come from
    ``routed_bytes``): the router's counts are data-dependent and do not run on fake tensors."""
    if not hasattr(mlp, "routed"):
        yield
        return
    mlp.routed = lambda x, ids=None: x * 1.0
    try:
        yield
    finally:
        del mlp.routed


class _FusedAttention(torch.autograd.Function):
    """Stands in for an attention kernel in the trace: keeps what a fused (flash-style) kernel
    keeps for backward, its inputs, its output and the log-sum-exp [..., s] in fp32, never a
    score matrix. ``heads_last``: DSA's sparse core, q [b, s, H, r] (lse [b, s, H]); else
    SDPA's q [b, H, s, d] (lse [b, H, s]). Indices and other integer inputs are kept as given."""

    @staticmethod
    def forward(ctx, q, k, v, *rest):
        out = q.new_empty(*q.shape[:-1], v.size(-1))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *(t for t in rest if isinstance(t, torch.Tensor)))
        return out

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("the planner's attention stand-in has no backward: its trace is forward-only "
                           "(megamoe.planning.activations)")


def _sdpa(q, k, v, *args, **kwargs):
    return _FusedAttention.apply(q, k, v)


def _sparse_core(q_lat, q_rope, c, k_rope, idx, scale):
    # output [b, s, H, r]: the latent width of c; q_rope and k_rope are kept with the rest
    return _FusedAttention.apply(q_lat, k_rope, c, q_rope, idx)


def _block_core(q, k, v, tok, scale):
    # block-sparse attention (letter B): q [b, s, H, d], keys and values [b, T, G, d], kept keys
    return _FusedAttention.apply(q, k, v, tok)


@contextlib.contextmanager
def _fused_attention(layer):
    """Attention kernels as a GPU run's fused ones keep memory (``_FusedAttention``) instead of
    the CPU fallbacks' [s, T] score matrices, which the planner would otherwise scale with the
    sequence; softmax attention (SDPA), DSA's sparse latent attention and block-sparse attention."""
    import torch.nn.functional as F

    sdpa, mixer = F.scaled_dot_product_attention, getattr(layer, "mixer", None)
    F.scaled_dot_product_attention = _sdpa
    stand_ins = {name: stub for name, stub in (("sparse_core", _sparse_core), ("block_core", _block_core))
                 if getattr(mixer, name, None) is not None}
    kept = {name: getattr(mixer, name) for name in stand_ins}
    for name, stub in stand_ins.items():
        setattr(mixer, name, stub)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        for name, core in kept.items():
            setattr(mixer, name, core)


def _traced_kind(layer, cfg, seq: int, act: int, params: set[int], info) -> dict[str, tuple[float, float]]:
    """One sequence of ``seq`` tokens through ``layer``: per part, (bytes saved of the part's
    input, bytes of the rest), unsharded; the MoE's routed experts are left to ``routed_bytes``.
    ``info``: the ``ForwardInfo`` of every kind traced, in layer order (an ``R`` layer reuses the
    selection an earlier ``D`` layer's trace left in its memo)."""
    dtype = next(layer.parameters()).dtype
    scale = act / torch.empty((), dtype=dtype).element_size()
    x = torch.empty(1, seq, cfg.hidden_size, dtype=dtype)
    out = {}
    for part in PARTS:
        module = getattr(layer, part, None)
        if module is None:
            continue
        n = x.clone().requires_grad_(True)  # the norm's input, or its output: a storage of its own
        if part.endswith("norm"):
            out[part] = _trace(module, (n,), params, scale)
            continue
        with _routed_stub(module), _fused_attention(layer):
            own, rest = _trace(lambda y: module(y, info), (n,), params, scale)
        out[part] = (own, rest)
    return out


def _fake_layers(cfg, kinds: dict[str, int]):
    """One layer of each kind (kind -> a layer index), built under FakeTensorMode, with the
    eager kernels (compiled fusion cannot trace fake tensors; the fused kernels save the same)."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from megamoe.model.build import build_model

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = build_model(dataclasses.replace(cfg, fusion="off"), layer_ids=sorted(kinds.values()),
                            pre_process=False, post_process=False)
    return mode, model


TRACE_TOKENS = 8192  # longer sequences: the traced figure grows linearly (see traced_kinds)
_TRACED: dict = {}


def traced_kinds(cfg, seq: int, act: int) -> tuple[int, dict[str, dict]]:
    """(traced length, per layer kind the per-part bytes of one sequence). Sequences longer
    than TRACE_TOKENS are traced at TRACE_TOKENS and scaled by the caller: linear in the length
    for every kernel the CPU backend runs on long sequences (chunked linear attention, flash
    attention, DSA's top-k), so a trace of a 1M-token sequence need not run its chunks."""
    seq = min(seq, TRACE_TOKENS)
    key = (repr(cfg), seq, act)
    if key not in _TRACED:
        from megamoe.layers.spec import ForwardInfo

        cfg, kinds = _with_mtp_kinds(cfg), {}
        for i, kind in enumerate(cfg.parsed_layout().layers):
            kinds.setdefault(str(kind), i)
        mode, model = _fake_layers(cfg, kinds)
        params = {id(p.untyped_storage()) for p in model.parameters()}
        with mode:
            info = ForwardInfo(positions=torch.arange(seq).expand(1, seq))
            _TRACED[key] = {k: _traced_kind(model.layers[str(i)], cfg, seq, act, params, info)
                            for k, i in sorted(kinds.items(), key=lambda item: item[1])}
    return seq, _TRACED[key]


def _with_mtp_kinds(cfg):
    """``cfg`` whose layout also holds the multi-token-prediction depths' layer kinds (after the
    last layer, as their layer numbers are), so one trace covers them too."""
    if cfg.mtp is None:
        return cfg
    import dataclasses

    kinds = [*cfg.parsed_layout().layers, *cfg.mtp.kinds()]
    return dataclasses.replace(cfg, layout="".join(str(k) for k in kinds), mtp=None)


def _split(parts: dict[str, tuple[float, float]], tp: int, sp: bool) -> dict[str, float]:
    """One rank's share of a traced layer's parts (module docstring: tensor parallelism)."""
    return {part: (own + rest) / (tp if sp else 1) if part.endswith("norm") else own + rest / tp
            for part, (own, rest) in parts.items()}


def head_bytes(cfg, tokens: float, *, tp: int, sp: bool, act: int) -> float:
    """The last stage's final norm input and vocab-parallel logits [b, s, V/tp] in fp32 kept for
    the loss, with the cross entropy's saved softmax of the same size."""
    vocab = math.ceil(cfg.vocab_size / tp)
    return tokens * (cfg.hidden_size * act / (tp if sp else 1) + 2 * vocab * 4)


def stage_activations(cfg, stages: list[list[int]], micro_batch: int, seq: int, *, tp: int, sp: bool,
                      etp: int, act: int, recompute=(), mtp: bool = False, cp: int = 1) -> list[dict]:
    """Per stage, for one rank: ``kept`` (bytes of one micro-batch's activations kept for
    backward), ``transient`` (the most one layer's recomputed forward adds while its backward
    runs) and ``working`` (the backward's working set: the largest part's kept bytes, a mixer
    or an MLP with its norm: the gradients its backward produces while what it saved is still
    held; e.g. the routed experts' per-copy gradients and their weight gradients' new terms). ``seq``: this rank's tokens per
    sequence (S / CP). ``mtp``: the multi-token-prediction depths train (``train.mtp_loss_weight``
    > 0): the last stage also keeps, per depth, its layer, its projection's input [b, s, 2h] and
    its logits as the head's. ``cp`` > 1: each mixer's bytes times its ``CP_MIXER_FACTORS``."""
    traced, per_kind = traced_kinds(cfg, seq, act)
    grow = micro_batch * seq / traced
    streams = cfg.hyper_connections.streams if cfg.hyper_connections is not None else 1
    stream = micro_batch * seq * streams * cfg.hidden_size * act / (tp if sp else 1)  # input [b, s(/tp), (n,) h]
    kinds = cfg.parsed_layout().layers
    routed = routed_bytes(cfg.moe, micro_batch * seq / tp, act, etp) if cfg.moe is not None else 0.0
    parts_of = {}  # kind -> (mixer with its norm, MLP with its norm) bytes
    for kind, parts in per_kind.items():
        b = {k: v * grow for k, v in _split(parts, tp, sp).items()}
        moe = routed if kind[-1] in MOE_LETTERS else 0.0  # the MoE splits its tokens over TP (with or without SP)
        mixer = b["mixer"] * (CP_MIXER_FACTORS.get(kind[0], 1.0) if cp > 1 else 1.0)
        parts_of[kind] = (b["input_norm"] + mixer, b.get("pre_mlp_norm", 0.0) + b.get("mlp", 0.0) + moe)
    rows = []
    for s, ids in enumerate(stages):
        kept, transient, working = 0.0, 0.0, 0.0
        for i in ids:
            mixer, mlp = parts_of[str(kinds[i])]
            working = max(working, mixer, mlp)
            if "layer" in recompute:
                kept += stream
                transient = max(transient, mixer + mlp)
                continue
            kept += (stream if "mixer" in recompute else mixer) + (stream if "mlp" in recompute and mlp else mlp)
            transient = max(transient, mixer if "mixer" in recompute else 0.0, mlp if "mlp" in recompute else 0.0)
        if s == len(stages) - 1:
            kept += head_bytes(cfg, micro_batch * seq, tp=tp, sp=sp, act=act)
            for kind in cfg.mtp.kinds() if mtp and cfg.mtp is not None else ():
                mixer, mlp = parts_of[str(kind)]
                working = max(working, mixer, mlp)
                kept += (2 * stream if "layer" in recompute else mixer + mlp + 2 * stream)
                kept += head_bytes(cfg, micro_batch * seq, tp=tp, sp=sp, act=act)
        rows.append({"kept": kept, "transient": transient, "working": working})
    return rows
