"""Shard-local initialisation (megamoe/parallel/init_rng.py, weights.initialize).

Each rank draws only its own piece, at the positions the piece has in the full tensor, so
the gathered tensors of any layout equal the single-process ones bitwise; a model that
loads a checkpoint draws nothing."""
from __future__ import annotations

import torch

from megamoe.core.config import ParallelConfig
from megamoe.parallel.init_rng import Draw, draw_blocks, flat_index, hash64, key_of
from megamoe.parallel.sharding import Shard, global_positions, set_sharding, split_full

M64 = (1 << 64) - 1


def _splitmix64(key: int, i: int) -> int:
    z = (i * 0x9E3779B97F4A7C15 + key) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_hash_is_splitmix64_in_wrapping_int64():
    key = key_of(3, "layers.0.mlp.fc1.weight")
    idx = torch.tensor([0, 1, 2, 12345, 2 ** 40 + 7])
    got = [h & M64 for h in hash64(key, idx).tolist()]
    assert got == [_splitmix64(key & M64, i) for i in idx.tolist()]


def test_draws_have_the_moments_of_their_distributions():
    d = Draw(key_of(0, "w"), torch.arange(1 << 20))
    n, u = d.normal(), d.uniform()
    assert abs(n.mean()) < 5e-3 and abs(n.std() - 1) < 5e-3     # 5 standard errors at 2^20 draws
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 2e-3
    other = Draw(key_of(1, "w"), torch.arange(1 << 20)).normal()
    assert abs(torch.corrcoef(torch.stack([n, other]))[0, 1]) < 5e-3  # seeds give independent streams
    assert abs(torch.corrcoef(torch.stack([n[:-1], n[1:]]))[0, 1]) < 5e-3


class _Grid:
    """Sizes and ranks of a layout, without processes (what global_positions reads)."""

    def __init__(self, sizes: dict, ranks: dict):
        self.sizes, self.ranks = sizes, ranks

    def size(self, name):
        return self.sizes.get(name, 1)

    def rank(self, name):
        return self.ranks.get(name, 0)


def test_global_positions_are_what_split_full_keeps():
    """Fused parts, two rules on two dims, and a padded (vocab) dim: each rank's positions
    index exactly the entries split_full gives it of the full tensor."""
    cases = [((12, 6), [Shard(0, "tp", (4, 8))], {"tp": 2}),             # q|kv parts
             ((8, 10, 4), [Shard(0, "ep"), Shard(1, "etp", (4, 6))], {"ep": 2, "etp": 2}),
             ((11, 3), [Shard(0, "tp", unpadded=11)], {"tp": 4})]           # 11 rows padded to 12
    for full_shape, rules, sizes in cases:
        full = torch.arange(1, 1 + torch.Size(full_shape).numel()).view(full_shape)
        names = list(sizes)
        for flat_rank in range(torch.Size([sizes[n] for n in names]).numel()):
            ranks = dict(zip(names, _unravel(flat_rank, [sizes[n] for n in names])))
            grid = _Grid(sizes, ranks)
            want = split_full(full, rules, grid)
            p = set_sharding(torch.empty(want.shape), *rules)
            pos = global_positions(p, grid)
            pad = torch.zeros(want.shape, dtype=torch.bool)
            for d, q in enumerate(pos):
                view = [1] * len(pos)
                view[d] = -1
                pad |= (q < 0).view(view)
            got = flat_index([q.clamp_min(0) for q in pos], full_shape) + 1
            assert torch.equal(torch.where(pad, 0, got), want), (full_shape, ranks)


def _unravel(i, sizes):
    out = []
    for s in reversed(sizes):
        out.append(i % s)
        i //= s
    return list(reversed(out))


def test_blocks_cover_the_shard_once(monkeypatch):
    import megamoe.parallel.init_rng as rng

    monkeypatch.setattr(rng, "BLOCK", 7)  # blocks of 2 rows of a [*, 3] shard
    pos = [torch.arange(5), torch.arange(3)]
    rows = [(b.start, b.stop, d.shape) for b, d, _ in draw_blocks(1, pos, (5, 3))]
    assert rows == [(0, 2, (2, 3)), (2, 4, (2, 3)), (4, 6, (1, 3))]


# ---- whole models across processes --------------------------------------------------------

MOE = ["model.layout=(GeAe)*1", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.vocab_size=250"]  # 250: the TP vocab is padded


def gathered_init(parallel: dict) -> dict:
    """Build the tiny hybrid MoE at a layout, initialise, gather every full tensor."""
    from megamoe.model.build import build_model
    from megamoe.parallel.groups import build_groups
    from megamoe.recipe import load_recipe
    from megamoe.model.weights import full_state_dict, initialize

    from megamoe.parallel.groups import ParallelGroups

    cfg = load_recipe("tiny_hybrid_moe", MOE).model
    groups = build_groups(ParallelConfig(**parallel)) if parallel else ParallelGroups()
    model = build_model(cfg, groups)
    initialize(model, groups, seed=11)
    return full_state_dict(model, groups)


def test_tp2_ep2_initialisation_equals_one_process_bitwise(pool):
    ref = gathered_init({})
    results = pool(4).run(gathered_init, {"tp": 2, "ep": 2})
    for state in results:
        assert state.keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(state[name], t), name


def load_counting_draws(root: str) -> int:
    """Train-save a tiny model, then build a trainer that loads it, counting random draws
    while it builds; the loaded weights must equal the saved ones."""
    from megamoe.parallel import init_rng
    from megamoe.recipe import load_recipe
    from megamoe.training.trainer import Trainer

    first = Trainer(load_recipe("tiny_train", [f"checkpoint.dir={root}", "train.steps=1", "data.seq_len=16"]))
    first.step = 1
    saved = first.save()
    drawn, real = [], init_rng.hash64
    init_rng.hash64 = lambda *a: drawn.append(a) or real(*a)   # every draw hashes its positions
    try:
        second = Trainer(load_recipe("tiny_train", [f"checkpoint.load={saved}", "data.seq_len=16",
                                                    "checkpoint.dir="]))
    finally:
        init_rng.hash64 = real
    for (n, a), b in zip(first.chunks[0].state_dict().items(), second.chunks[0].state_dict().values()):
        assert torch.equal(a, b), n
    return len(drawn)


def test_a_model_that_loads_a_checkpoint_draws_nothing(tmp_path, pool):
    """checkpoint.load: the trainer builds empty shards and the checkpoint fills them."""
    assert pool(1).run(load_counting_draws, str(tmp_path)) == [0]


def test_normal_draws_stay_finite_at_the_top_uniform():
    """The largest uniform (24 bits all set) maps to a finite normal, not erfinv(1) = inf (the
    quickstart with train.seed=2 met it in an expert weight and trained on NaN)."""
    import torch

    from megamoe.parallel.init_rng import Draw

    class Top(Draw):
        def uniform(self):
            return torch.full(self.shape, 2.0 ** 24 - 1).add_(0.5).mul_(2.0 ** -24)

    top = Top(0, torch.zeros(3, dtype=torch.long)).normal()
    assert torch.isfinite(top).all() and 5.0 < top.min().item() < 5.6


def test_uniform_draws_stay_below_one_at_the_top_bits(monkeypatch):
    """With all 24 bits set the uniform is the float below 1, never 1 itself (1 - 2^-25 is not
    a float32): log_uniform/erfinv-style rules never see the closed end."""
    import megamoe.parallel.init_rng as rng

    monkeypatch.setattr(rng, "hash64", lambda key, index: torch.full(index.shape, -1, dtype=torch.int64))
    u = rng.Draw(0, torch.zeros(4, dtype=torch.long)).uniform()
    assert (u < 1).all() and u.max().item() == 1 - 2.0 ** -24
