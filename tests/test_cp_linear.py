"""Linear attention (G, K, L) under context parallelism and with packed documents.

CP=2, CP=4 and CP=2 x TP=2 (with SP) equal the single-process run (outputs, input gradients,
every parameter gradient summed over CP) at lengths that are not powers of two, with the
strongest decays the inits produce (G: A = 16, about -21 per token, so the chunk transitions
underflow to 0); a packed sequence equals its documents run one by one; the bytes a layer
exchanges do not depend on the sequence length."""
from __future__ import annotations

import math

import pytest
import torch

from megamoe.layers.cache.decode import InferenceCache
from megamoe.core.errors import ConfigError
from megamoe.diagnostics.memory import saved_tensor_bytes
from megamoe.layers.spec import ForwardInfo
from tests.mixer_utils import build_mixer, param_grad_errors, tiny_model
from tests.numerics import rel_err

REL = 1e-5
LETTERS = ["G", "K", "L"]


def _config(backend: str = "auto"):
    return tiny_model("GdKdLd", backend=backend)


@torch.no_grad()
def _strong_decays(mixer, letter: str) -> None:
    """Decay rates at the ends of the inits' ranges: A_log in log U(1, 16) (G, K); K's dt_bias at
    its init's largest dt (0.1) on half the channels and at softplus^-1(2) on the others (past the
    init, so that K's chunk transitions underflow too)."""
    if letter == "L":
        return
    heads = mixer.A_log.numel()
    mixer.A_log.copy_(torch.tensor([math.log(16.0), 0.0, math.log(4.0), math.log(16.0)][:heads]))
    if letter == "K":
        inv = lambda dt: dt + math.log(-math.expm1(-dt))  # noqa: E731  softplus^-1
        half = mixer.dt_bias.numel() // 2
        mixer.dt_bias[:half], mixer.dt_bias[half:] = inv(0.1), inv(2.0)


def documents(b: int, seq_len: int) -> torch.Tensor:
    """[b, S] document ids: row 0 has starts inside chunks and a one-token document, row 1 one start
    at the middle (a chunk boundary for every CP size)."""
    starts = [[0, 5, 11, seq_len - 7, seq_len - 6], [0, seq_len // 2]][:b]
    docs = torch.zeros(b, seq_len, dtype=torch.long)
    for r, row in enumerate(starts):
        for a in row[1:]:
            docs[r, a:] += 1
    return docs


def _inputs(seq_len: int, hidden: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, seq_len, hidden, generator=gen), torch.randn(2, seq_len, hidden, generator=gen)


def _reference(letter: str, seq_len: int, packed: bool, backend: str = "auto"):
    cfg = _config(backend)
    ref = build_mixer(letter, cfg)
    _strong_decays(ref, letter)
    x, dy = _inputs(seq_len, cfg.hidden_size)
    docs = documents(2, seq_len) if packed else None
    xr = x.clone().requires_grad_(True)
    yr = ref(xr, ForwardInfo(positions=torch.arange(seq_len).expand(2, -1), documents=docs))
    (yr * dy).sum().backward()
    return cfg, ref, x, dy, docs, xr, yr


# ---- CP (x TP) against one process: run on every rank of a gloo pool ----------------------------

def cp_case(letter: str, cp: int, tp: int, seq_len: int, packed: bool, backend: str = "auto") -> dict:
    from megamoe.core.config import ParallelConfig
    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups
    from megamoe.model.weights import finalize_grads

    cfg, ref, x, dy, docs, xr, yr = _reference(letter, seq_len, packed, backend)
    groups = build_groups(ParallelConfig(cp=cp, tp=tp))
    sp = tp > 1
    par = build_mixer(letter, cfg, groups, sp=sp, full_state={n: p.detach() for n, p in ref.named_parameters()})
    shard = ContextShard(groups.cp, seq_len)
    # under SP the CP-local tokens are cut again over TP
    local = (lambda t: shard.split(t).chunk(tp, dim=1)[groups.tp_rank]) if sp else shard.split
    xp = local(x).requires_grad_(True)
    info = ForwardInfo(positions=shard.split(torch.arange(seq_len).expand(2, -1)), cp=shard, documents=docs)
    yp = par(xp, info)
    (yp * local(dy)).sum().backward()
    finalize_grads(par, groups)
    errs = {"out": rel_err(yp, local(yr)), "grad x": rel_err(xp.grad, local(xr.grad))}
    return param_grad_errors(ref, par, groups, errs, cp_group=groups.cp)  # each CP rank saw its tokens only


def _check(results: list[dict], what: str) -> None:
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"{what} rank {rank}: relative errors over {REL}: {bad}"
    assert any(k.startswith("grad A_log") or k.startswith("grad linear_qkv") for k in results[0])


@pytest.mark.parametrize("letter", LETTERS)
@pytest.mark.parametrize("seq_len,packed", [(24, False), (72, True)], ids=["S24", "S72-packed"])
def test_cp2_equals_one_process(pool, letter, seq_len, packed):
    _check(pool(2).run(cp_case, letter, 2, 1, seq_len, packed), f"{letter} cp2 S={seq_len}")


@pytest.mark.parametrize("letter", LETTERS)
def test_cp2_through_the_local_backend(pool, letter):
    """The same scheme over another backend's roles (token-by-token ops, torch's conv1d)."""
    _check(pool(2).run(cp_case, letter, 2, 1, 24, True, "local"), f"{letter} cp2 local")


@pytest.mark.parametrize("letter", LETTERS)
def test_cp4_equals_one_process(pool, letter):
    _check(pool(4).run(cp_case, letter, 4, 1, 40, True), f"{letter} cp4")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("letter", LETTERS)
def test_cp2_tp2_sp_equals_one_process(pool, letter, packed):
    _check(pool(4).run(cp_case, letter, 2, 2, 24, packed), f"{letter} cp2xtp2")


def cp_prefill_case(letter: str, lengths: tuple[int, ...] = (24, 24), steps: int = 3) -> dict:
    """Prefill in pieces under CP=2 (the second continues from the cached state), then decode
    ``steps`` tokens without CP, against the same in one process: outputs and cached states."""
    from megamoe.core.config import ParallelConfig
    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups

    cfg = _config()
    ref = build_mixer(letter, cfg)
    _strong_decays(ref, letter)
    groups = build_groups(ParallelConfig(cp=2))
    par = build_mixer(letter, cfg, groups, full_state={n: p.detach() for n, p in ref.named_parameters()})
    x, _ = _inputs(sum(lengths) + steps, cfg.hidden_size, seed=1)
    ref_cache, cp_cache, errs, start = InferenceCache(2), InferenceCache(2), {}, 0
    with torch.no_grad():
        for i, n in enumerate(lengths + (1,) * steps):
            piece = x[:, start:start + n]
            want = ref(piece, ForwardInfo(positions=ref_cache.positions(n), cache=ref_cache))
            if n > 1:  # a prefill piece: CP
                shard = ContextShard(groups.cp, n)
                info = ForwardInfo(positions=shard.split(cp_cache.positions(n)), cache=cp_cache, cp=shard)
                errs[f"out {i}"] = rel_err(par(shard.split(piece), info), shard.split(want))
            else:
                errs[f"out {i}"] = rel_err(par(piece, ForwardInfo(positions=cp_cache.positions(1), cache=cp_cache)),
                                           want)
            ref_cache.advance(n)
            cp_cache.advance(n)
            start += n
            if i == len(lengths) - 1:  # after the CP prefill: the usual state layout, every rank
                mine, theirs = cp_cache.layer(par.layer_number), ref_cache.layer(ref.layer_number)
                assert sorted(mine) == sorted(theirs), (sorted(mine), sorted(theirs))
                errs.update({f"state {k}": rel_err(mine[k], theirs[k]) for k in theirs})
    return errs


@pytest.mark.parametrize("letter", LETTERS)
def test_cp_prefill_leaves_the_decode_cache(pool, letter):
    for rank, errs in enumerate(pool(2).run(cp_prefill_case, letter)):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad and len(errs) >= 6, f"{letter} rank {rank}: {errs}"


# ---- bytes exchanged per layer -----------------------------------------------------------------

def exchanged_bytes(letter: str, lengths: list[int]) -> list[int]:
    """Bytes each rank receives from all-gathers in one forward of the mixer, per length (CP only)."""
    import torch.distributed as dist

    from megamoe.core.config import ParallelConfig
    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(cp=dist.get_world_size()))
    cfg = _config()
    mixer = build_mixer(letter, cfg, groups)
    counted, real = [0], dist.all_gather

    def counting(parts, x, group=None, **kw):
        counted[0] += sum(p.numel() * p.element_size() for p in parts)
        return real(parts, x, group=group, **kw)

    out = []
    dist.all_gather = counting
    try:
        for n in lengths:
            counted[0] = 0
            shard = ContextShard(groups.cp, n)
            x = shard.split(torch.randn(2, n, cfg.hidden_size))
            with torch.no_grad():
                mixer(x, ForwardInfo(positions=shard.split(torch.arange(n).expand(2, -1)), cp=shard))
            out.append(counted[0])
    finally:
        dist.all_gather = real
    return out


def expected_bytes(letter: str, cp: int, b: int = 2) -> int:
    """The docs' formula: 2·CP·b·4 bytes times hv·dk·(dk+dv) (G, K) or h·dk·dv (L), plus the conv
    halo 2·CP·b·(K-1)·C·4 (G, K)."""
    cfg = _config()
    if letter == "L":
        d = cfg.lightning.dim(cfg.hidden_size)
        return 2 * cp * b * 4 * cfg.lightning.num_heads * d * d
    if letter == "G":
        g = cfg.gdn
        hv, dk, dv, kernel = g.num_value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel
        channels = 2 * g.num_key_heads * dk + hv * dv
    else:
        hv, dk, dv, kernel = cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.head_dim, cfg.kda.conv_kernel
        channels = 3 * hv * dk
    return 2 * cp * b * 4 * (hv * dk * (dk + dv) + (kernel - 1) * channels)


@pytest.mark.parametrize("letter", LETTERS)
def test_exchanged_bytes_do_not_grow_with_length(pool, letter):
    for got in pool(2).run(exchanged_bytes, letter, [24, 120]):
        assert got == [expected_bytes(letter, 2)] * 2


def short_chunks(letter: str) -> str:
    import torch.distributed as dist

    from megamoe.core.config import ParallelConfig
    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(cp=dist.get_world_size()))
    cfg = _config()
    mixer = build_mixer(letter, cfg, groups)
    shard = ContextShard(groups.cp, 4)  # chunks of one token, kernel - 1 >= 2
    padded = InferenceCache(2, pad=torch.tensor([0, 1]))
    messages = []
    for cache in (None, padded):
        try:
            mixer(torch.zeros(2, 2, cfg.hidden_size), ForwardInfo(positions=torch.zeros(2, 2), cp=shard, cache=cache))
            messages.append("no error")
        except ConfigError as e:
            messages.append(str(e))
    return messages


def test_cp_errors_are_one_line(pool):
    for short, padded in pool(2).run(short_chunks, "G"):
        assert "chunks of 1 tokens are shorter than the short convolution's kernel - 1 = 3" in short
        assert padded.startswith("mixer G: context parallelism with a left-padded decode cache is not supported")


# ---- activation memory -----------------------------------------------------------------------

def saved_bytes(mixer, x: torch.Tensor, info: ForwardInfo) -> int:
    """Bytes autograd keeps for backward during one forward of ``mixer`` (each storage once, the
    parameters left out): what the layer holds between its forward and its backward."""
    return saved_tensor_bytes(lambda: mixer(x, info).sum().backward(), mixer.parameters())[0]


def saved_ratio(letter: str, seq_len: int, recompute: bool = False) -> float:
    """One CP=2 rank's saved bytes over the single-process run's, same weights and inputs;
    ``recompute``: train.recompute=[core] on both."""
    import torch.distributed as dist

    from megamoe.core.config import ParallelConfig
    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups

    cfg = _config()
    one = build_mixer(letter, cfg)
    x, _ = _inputs(seq_len, cfg.hidden_size)
    full = saved_bytes(one, x.clone().requires_grad_(True),
                       ForwardInfo(positions=torch.arange(seq_len).expand(2, -1)))
    groups = build_groups(ParallelConfig(cp=dist.get_world_size()))
    par = build_mixer(letter, cfg, groups, full_state={n: p.detach() for n, p in one.named_parameters()})
    one.recompute_core = par.recompute_core = recompute
    shard = ContextShard(groups.cp, seq_len)
    info = ForwardInfo(positions=shard.split(torch.arange(seq_len).expand(2, -1)), cp=shard)
    return saved_bytes(par, shard.split(x).requires_grad_(True), info) / full


@pytest.mark.parametrize("letter", ["G", "K"])
def test_cp2_delta_rule_keeps_less_than_half(pool, letter):
    """With train.recompute=[core] the widened state-passing run is recomputed in backward, so a
    CP=2 rank keeps less than half of what one process keeps for the whole sequence; kept (the
    default), about 0.55 of it."""
    for ratio in pool(2).run(saved_ratio, letter, 512, True):
        assert ratio < 0.5, f"{letter}: a CP=2 rank keeps {ratio:.3f} of the single-process activations"
    for ratio in pool(2).run(saved_ratio, letter, 512):
        assert ratio < 0.6, f"{letter}: a CP=2 rank keeps {ratio:.3f} of the single-process activations"


# ---- packed documents, one process --------------------------------------------------------------

@pytest.mark.parametrize("letter", LETTERS)
def test_packed_documents_equal_documents_one_by_one(letter):
    seq_len = 30
    cfg, ref, x, dy, docs, xr, yr = _reference(letter, seq_len, packed=True)
    one = build_mixer(letter, cfg, full_state={n: p.detach() for n, p in ref.named_parameters()})
    xs = x.clone().requires_grad_(True)
    pieces = torch.empty_like(yr)
    for r in range(2):
        for d in docs[r].unique():
            idx = (docs[r] == d).nonzero().flatten()
            a, e = idx[0].item(), idx[-1].item() + 1
            pieces[r:r + 1, a:e] = one(xs[r:r + 1, a:e], ForwardInfo(positions=torch.arange(e - a)[None]))
    (pieces * dy).sum().backward()
    assert rel_err(yr, pieces) < REL and rel_err(xr.grad, xs.grad) < REL
    theirs = dict(one.named_parameters())
    for name, p in ref.named_parameters():
        assert rel_err(p.grad, theirs[name].grad) < REL, name
    # the documents really interact when not separated
    plain = ref(x, ForwardInfo(positions=torch.arange(seq_len).expand(2, -1)))
    assert rel_err(plain, yr) > 1e-3


def test_documents_with_decode_cache_is_one_line():
    cfg = _config()
    mixer = build_mixer("G", cfg)
    info = ForwardInfo(positions=torch.zeros(1, 4, dtype=torch.long), cache=InferenceCache(1),
                       documents=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"mixer G: packed documents \(ForwardInfo.documents\) with a decode cache"):
        mixer(torch.zeros(1, 4, cfg.hidden_size), info)


def test_lightning_ops_reset_at_document_starts():
    """The chunked and recurrent Lightning ops with ``resets`` equal each document run alone (float64)."""
    from megamoe.layers.ops.lightning import lightning_chunked, lightning_recurrent

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 23, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    slope = torch.tensor([0.9, 0.1, 0.02], dtype=torch.float64)
    docs = documents(2, 23)
    resets = torch.nn.functional.pad(docs[:, 1:] != docs[:, :-1], (1, 0))
    chunked, _ = lightning_chunked(q, k, v, slope, block=4, resets=resets)
    recurrent, _ = lightning_recurrent(q, k, v, slope, resets=resets)
    for r in range(2):
        for d in docs[r].unique():
            idx = (docs[r] == d).nonzero().flatten()
            part = slice(idx[0].item(), idx[-1].item() + 1)
            alone, _ = lightning_recurrent(q[r:r + 1, part], k[r:r + 1, part], v[r:r + 1, part], slope)
            torch.testing.assert_close(chunked[r:r + 1, part], alone, rtol=0, atol=1e-12)
            torch.testing.assert_close(recurrent[r:r + 1, part], alone, rtol=0, atol=1e-12)
