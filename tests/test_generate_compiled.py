"""Compiled decode steps (``generate_batch(..., compile=True)``): a hybrid MoE model's one-token
steps run as one graph each (no graph break: the routed experts are one opaque op), with the
eager steps' tokens and, to rounding, their logits, over a left-padded batch."""
from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from megamoe.layers.ops import fusion
from megamoe.layers.cache.decode import InferenceCache
from megamoe.core.config import GDNConfig, MoEConfig
from megamoe.core.errors import ConfigError
from megamoe.inference.generate import compiled_forward, decode_step, generate_batch, left_pad, prefill
from tests.mixer_utils import tiny_model
from tests.numerics import max_abs

needs_compiler = pytest.mark.skipif(not fusion._have_cxx(), reason="no C++ compiler for inductor's CPU kernels")
LENGTHS = (5, 9, 2, 7)


def hybrid_moe():
    from megamoe.model.language_model import LanguageModel
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.model.weights import initialize

    cfg = tiny_model("GeAe", gdn=GDNConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8,
                                          chunk_size=8),
                     moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, num_shared_experts=1,
                                   shared_expert_gate=True))
    model = LanguageModel(cfg).eval()
    initialize(model, ParallelGroups(), seed=0)
    return model


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 61, (n,), generator=gen).tolist() for n in LENGTHS]


@needs_compiler
def test_compiled_decode_steps_are_one_graph_with_the_eager_tokens_and_logits():
    model, ps = hybrid_moe(), prompts()
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    assert generate_batch(model, ps, 6, compile=True) == generate_batch(model, ps, 6)
    assert sum(counters["graph_break"].values()) == breaks  # the whole step is one graph
    assert counters["stats"]["unique_graphs"] > graphs  # and it was compiled, not run eagerly

    ids, pad = left_pad(ps)
    step = compiled_forward(model)
    with torch.no_grad():
        caches = InferenceCache(len(ps), pad=pad), InferenceCache(len(ps), pad=pad)
        token = prefill(model, ids, caches[0], None).argmax(-1)
        prefill(model, ids, caches[1], None)
        for _ in range(4):  # compiled and eager steps on the same tokens
            with decode_step(model):
                eager = model(token.unsqueeze(1), cache=caches[0])[:, -1]
                compiled = step(token.unsqueeze(1), cache=caches[1])[:, -1]
            assert max_abs(compiled, eager) <= 1e-5 * eager.abs().max()
            token = eager.argmax(-1)


@needs_compiler
def test_compiled_decode_with_a_paged_cache_is_one_graph_with_the_eager_tokens(monkeypatch):
    """A paged cache (fp32 and int8 blocks; int8 read 4 steps a tile, so several tiles and, as the
    cache is reserved for the generation (``PagedCache.reserve``), tiles past the kept steps) under
    compiled steps: a step writes and reads its blocks inside the one graph (no graph break),
    with the eager paged cache's tokens."""
    from megamoe.layers.cache import paged

    monkeypatch.setattr(paged, "TILE_TOKENS", 4)
    monkeypatch.setattr(paged, "TILE_MIN_TOKENS", 4)
    model, ps = hybrid_moe(), prompts()
    for kv in ("fp32", "int8"):
        cache = functools.partial(paged.PagedCache, kv_dtype=kv, block_size=4)
        breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
        assert generate_batch(model, ps, 6, compile=True, cache_factory=cache) == \
            generate_batch(model, ps, 6, cache_factory=cache)
        assert sum(counters["graph_break"].values()) == breaks and counters["stats"]["unique_graphs"] > graphs


def test_compiled_decode_refuses_a_paged_cache_for_deepseek_v4_layers():
    """V4's compressed entries are kept per row on the host: refused in one line before the prefill."""
    from megamoe.layers.cache.paged import PagedCache
    from megamoe.model.language_model import LanguageModel
    from tests.v4_utils import tiny_v4

    with pytest.raises(ConfigError, match=r"not for DeepSeek-V4's layers \(C, H, W"):
        generate_batch(LanguageModel(tiny_v4()).eval(), prompts(), 2, compile=True,
                       cache_factory=functools.partial(PagedCache, kv_dtype="int8"))


def test_compiled_decode_refuses_a_custom_forward():
    model = hybrid_moe()
    with pytest.raises(ConfigError, match="compile"):
        generate_batch(model, prompts(), 2, compile=True, forward=model)


def test_generate_refuses_compile_with_parallel_flags_before_loading(tmp_path):
    from megamoe.commands.generate import main

    with pytest.raises(ConfigError, match="--compile with --pp/--cp"):
        main([str(tmp_path / "not-loaded"), "--ids", "1,2", "--compile", "--pp", "2"])


def test_the_opaque_experts_op_is_the_eager_dispatch_and_only_for_plain_experts():
    """``local_dispatch`` (what a compiled step calls) gives bitwise the eager single-rank
    dispatch's output, and declines (None: the dispatch then runs outside the graph) for experts
    computing otherwise, here LoRA-adapted ones, and when a gradient is wanted."""
    from megamoe.layers.mlp.dispatch import dispatch_local
    from megamoe.lora import LoRAConfig, apply_lora

    model = hybrid_moe()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 32, generator=gen)
    weights, idx = torch.rand(6, 2, generator=gen), torch.randint(0, 4, (6, 2), generator=gen)
    experts = model.get_submodule("layers.0.mlp.experts")
    with torch.no_grad():
        assert torch.equal(experts.local_dispatch(x, weights, idx), dispatch_local(x, weights, idx, None, experts, 4))
    assert experts.local_dispatch(x, weights, idx) is None  # parameters want gradients here
    adapted = apply_lora(hybrid_moe(), LoRAConfig(rank=2, targets=["experts"])).get_submodule("layers.0.mlp.experts")
    with torch.no_grad():
        assert adapted.local_dispatch(x, weights, idx) is None
    handle = experts.register_forward_hook(lambda *a: None)  # the op would skip the module's hooks
    with torch.no_grad():
        assert experts.local_dispatch(x, weights, idx) is None
    handle.remove()


def compiled_at(hf_dir: str, layout: dict, kv: str | None = None) -> tuple[list, list, int]:
    """On every rank: this rank's shards decoded eagerly and with compiled steps (each rank its own
    graphs, the TP collectives inside them, an EP exchange outside); ``kv``: a paged cache of
    those blocks (its head shard on each rank), else the contiguous one."""
    from megamoe.core.config import ParallelConfig
    from megamoe.inference.distributed import inference_groups
    from megamoe.inference.load import load_model
    from megamoe.layers.cache.paged import PagedCache

    model = load_model(hf_dir, groups=inference_groups(ParallelConfig(**layout)))
    ps, graphs = prompts(), counters["stats"]["unique_graphs"]
    cache = {} if kv is None else {"cache_factory": functools.partial(PagedCache, kv_dtype=kv, block_size=4)}
    eager = generate_batch(model, ps, 5, **cache)
    return eager, generate_batch(model, ps, 5, compile=True, **cache), counters["stats"]["unique_graphs"] - graphs


@needs_compiler
@pytest.mark.parametrize("layout,world", [(dict(tp=2), 2), (dict(ep=2), 2), (dict(tp=2, ep=2), 4)],
                         ids=["tp2", "ep2", "tp2ep2"])
def test_compiled_decoding_at_tp2_and_ep2_gives_the_eager_tokens(pool, tmp_path_factory, layout, world):
    """TP=2: the collectives traced into the rank's graph (also over an int8 paged cache); EP=2:
    the expert exchange outside it; TP=2 x EP=2 (four processes): both at once."""
    from megamoe.convert import from_hf
    from tests.test_convert_qwen import tiny_qwen3_next

    hf_dir = tmp_path_factory.mktemp("qwen3_next") / "hf"
    tiny_qwen3_next().save_pretrained(hf_dir)
    want = generate_batch(from_hf(hf_dir), prompts(), 5)
    # compiling takes minutes on a loaded 2-core machine: a longer wait than the pool's default
    for eager, compiled, graphs in pool(world).run(compiled_at, str(hf_dir), layout, timeout=900):
        assert eager == want and compiled == want and graphs > 0
    if layout == dict(tp=2):  # a paged int8 cache on each rank's heads: the eager paged tokens
        for eager, compiled, graphs in pool(world).run(compiled_at, str(hf_dir), layout, "int8", timeout=900):
            assert compiled == eager and graphs > 0
