"""Context parallelism on the model/trainer side: the model cuts ids, positions and labels to
each rank's 2·CP chunks, the loss and the MoE statistics aggregate over CP, the trainer hands
CP ranks the same samples; every one of them equals the single-process run."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.core.config import AttentionConfig, GDNConfig, MLPConfig, ModelConfig, MoEConfig, ParallelConfig
from megamoe.data import DataConfig
from megamoe.core.errors import ConfigError
from megamoe.training.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig
from megamoe.recipe import Recipe as TrainRecipe
from tests.numerics import rel_err
from tests.test_trainer_parity import first_steps

SEQ = 24  # 2·CP·k with k odd (6 chunks of 4 at CP=2... 4 chunks of 6): not a power of two
MOE = dict(num_experts=4, top_k=2, moe_ffn_hidden_size=32, num_shared_experts=1, shared_expert_gate=True,
           expert_bias=True, aux_loss_coeff=1e-2, seq_aux_loss_coeff=1e-2, z_loss_coeff=1e-3)


def tiny_model(layout: str = "GeSdAe") -> ModelConfig:
    """A tiny hybrid MoE: Gated DeltaNet, sliding-window and full gated softmax attention."""
    return ModelConfig(vocab_size=64, hidden_size=32, layout=layout,
                       attention=AttentionConfig(num_heads=4, num_kv_heads=2, qk_norm=True, output_gate=True,
                                                 partial_rotary_factor=0.5, sliding_window=5),
                       gdn=GDNConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8,
                                     chunk_size=8),
                       mlp=MLPConfig(ffn_hidden_size=64), moe=MoEConfig(**MOE), norm_zero_centered=True)


# ---- one forward and backward of the model -------------------------------------------------------

def model_case(parallel: dict | None, sp: bool = False) -> dict:
    """Loss, gathered logits, every gradient (summed like the trainer does, gathered to full size)
    and the MoE metrics of one training forward on a fixed batch with masked labels."""
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.model.moe_controls import moe_metrics
    from megamoe.parallel.groups import ParallelGroups, build_groups
    from megamoe.parallel.sharding import gather_full
    from megamoe.training.grads import sync_grads
    from megamoe.model.weights import initialize

    groups = build_groups(ParallelConfig(**parallel)) if parallel else ParallelGroups()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (2, SEQ), generator=gen)
    labels = shift_labels(ids)
    labels[0, 3:9] = -100  # masked targets on both CP ranks' chunks
    model = LanguageModel(tiny_model(), groups, sequence_parallel=sp)
    initialize(model, groups, seed=3)
    model.train()
    loss = model(ids, labels=labels)
    loss.backward()
    sync_grads([model], groups)
    metrics = moe_metrics(model, groups)
    model.eval()
    with torch.no_grad():
        logits = model(ids)
    shard = model.sequence_shard(SEQ)
    if shard is not None:
        logits = shard.gather(logits, 1)
    grads = {n: gather_full(p, groups, p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "logits": logits, "grads": grads, "metrics": metrics}


@pytest.fixture(scope="module")
def single():
    return model_case(None)


def check_model(got: dict, ref: dict, what: str) -> None:
    assert rel_err(got["loss"], ref["loss"]) <= 1e-6, (what, got["loss"], ref["loss"])
    assert rel_err(got["logits"], ref["logits"]) <= 1e-5, what
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert rel_err(got["grads"][name], g) <= 1e-5, (what, name, rel_err(got["grads"][name], g))
    for layer, m in ref["metrics"].items():  # load, entropy and the balancing losses over all tokens
        mine = got["metrics"][layer]
        assert mine["tokens_per_expert"] == m["tokens_per_expert"], (what, layer)
        for key in ("router_entropy", "aux_loss", "seq_aux_loss", "z_loss"):
            assert abs(mine[key] - m[key]) <= 1e-6 * max(1.0, abs(m[key])), (what, layer, key, mine[key], m[key])


@pytest.mark.parametrize("n,parallel,sp", [
    (2, dict(cp=2), False),
    (4, dict(cp=4), False),
    (4, dict(cp=2, tp=2), False),
    (4, dict(cp=2, tp=2), True),
    (4, dict(cp=2, tp=2, ep=2), True),
], ids=["cp2", "cp4", "cp2-tp2", "cp2-tp2-sp", "cp2-tp2-sp-ep2"])
def test_model_forward_backward_match_single(pool, single, n, parallel, sp):
    for rank, got in enumerate(pool(n).run(model_case, parallel, sp)):
        check_model(got, single, f"{parallel} sp={sp} rank {rank}")


# ---- the trainer -----------------------------------------------------------------------------------

STEPS = 200
TOL = 1e-5


def tiny_recipe(parallel: ParallelConfig, steps: int = STEPS, **checkpoint) -> TrainRecipe:
    """Gated DeltaNet over MoE (routed + shared experts, expert bias, the three balancing losses),
    gated softmax attention over a dense MLP. As in tests/test_trainer_parity.py the tiny MoE is
    chaotic: a routing decision that fp32 rounding flips shows as a jump of 1e-5..1e-3 that stays
    (train.seed=7 flips one near step 50 without compiled fusion); seed 1 has no near-tie."""
    return TrainRecipe(model=tiny_model("GeAd"), parallel=parallel,
                       data=DataConfig(kind="synthetic", seq_len=SEQ, seed=3),
                       train=TrainConfig(steps=steps, micro_batch_size=2, global_batch_size=4, seed=1),
                       optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=5, clip_grad=1.0),
                       checkpoint=CheckpointConfig(**checkpoint),
                       logging=LoggingConfig(progress=False, latency_interval=0))


def run_recipe(recipe: TrainRecipe, log_dir: str) -> list[float]:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer

    trainer = Trainer(recipe, SyntheticDataset(recipe.model.vocab_size, SEQ, seed=recipe.data.seed))
    return [h["loss"] for h in trainer.fit(log_dir)]


@pytest.fixture(scope="module")
def reference(pool, tmp_path_factory):
    return pool(1).run(run_recipe, tiny_recipe(ParallelConfig()), str(tmp_path_factory.mktemp("ref")))[0]


@pytest.mark.parametrize("n,parallel,steps", [
    (2, ParallelConfig(cp=2), STEPS),
    # the four-process grids follow the first 50 steps (a step there costs 3-4x CP=2's; the
    # long curve is CP=2's above, as tests/test_trainer_parity.py keeps it for its cheap layouts)
    (4, ParallelConfig(cp=2, tp=2, ep=2, sequence_parallel=True), 50),
    (4, ParallelConfig(cp=2, pp=2), 50),
], ids=["cp2", "cp2-tp2-sp-ep2", "cp2-pp2"])
def test_trainer_loss_curve_matches_single(pool, reference, n, parallel, steps, tmp_path):
    """At PP=2 the layout is cut after the first layer ("Ge|Ad": the same model, stage 1 gets
    the local hidden states of both CP chunks)."""
    recipe = first_steps(tiny_recipe(parallel), steps)
    if parallel.pp > 1:
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, layout="Ge|Ad"))
    losses = pool(n).run(run_recipe, recipe, str(tmp_path))
    assert all(curve == losses[0] for curve in losses)  # every rank reports the same global loss
    assert len(losses[0]) == steps and len(reference) == STEPS
    diff = max(abs(a - b) for a, b in zip(losses[0], reference))
    assert diff <= TOL, f"{parallel}: loss curve differs from single-process by {diff:.2e} over {steps} steps"
    assert reference[-1] < reference[0] - 0.3  # and it learns


RESUME_AT = 6


def resume_case(parallel: ParallelConfig, ckpt_dir: str, log_dir: str) -> list[float]:
    return run_recipe(tiny_recipe(parallel, 2 * RESUME_AT, dir=ckpt_dir, save_interval=RESUME_AT), log_dir)


@pytest.mark.parametrize("first,then", [(1, 2), (2, 1)], ids=["cp1-then-cp2", "cp2-then-cp1"])
def test_resume_at_another_cp_size(pool, first, then, tmp_path):
    """A 12-step run at one CP size saves at step 6; resumed from there at the other CP size, steps
    7..12 repeat its losses (model, optimizer state and data position do not depend on CP)."""
    import shutil

    whole = pool(first).run(resume_case, ParallelConfig(cp=first), str(tmp_path / "a"), str(tmp_path / "log_a"))[0]
    shutil.copytree(tmp_path / "a" / f"step_{RESUME_AT:08d}", tmp_path / "b" / f"step_{RESUME_AT:08d}")
    tail = pool(then).run(resume_case, ParallelConfig(cp=then), str(tmp_path / "b"), str(tmp_path / "log_b"))[0]
    assert len(whole) == 2 * RESUME_AT and len(tail) == RESUME_AT
    diff = max(abs(a - b) for a, b in zip(tail, whole[RESUME_AT:]))
    assert diff <= TOL, f"cp={first} then cp={then}: steps after the resume differ by {diff:.2e}"


# ---- one-line errors ---------------------------------------------------------------------------------

def test_length_not_divisible_by_two_cp_is_one_line():
    recipe = tiny_recipe(ParallelConfig(cp=4))
    recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, seq_len=36))
    with pytest.raises(ConfigError) as e:
        recipe.validate()
    assert str(e.value) == ("data.seq_len 36 is not divisible by 2*parallel.cp = 8 (context parallelism cuts "
                            "each sequence into 2*cp equal chunks)")
    sp = tiny_recipe(ParallelConfig(cp=2, tp=4, sequence_parallel=True))
    model = dataclasses.replace(sp.model, layout="Ad",
                                attention=dataclasses.replace(sp.model.attention, num_kv_heads=4))
    sp = dataclasses.replace(sp, model=model, data=DataConfig(kind="synthetic", seq_len=20))
    with pytest.raises(ConfigError, match=r"^data.seq_len 20 / parallel.cp=2 is not divisible by parallel.tp=4 "):
        sp.validate()


# ---- the planner ---------------------------------------------------------------------------------------

def planned_vs_held_case() -> dict:
    """Optimizer-state bytes this CP=2 rank holds after one step (ZeRO-1 over dp_cp) against the plan."""
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.planning.plan import stage_memory
    from megamoe.training.trainer import Trainer

    recipe = tiny_recipe(ParallelConfig(cp=2), steps=1)
    trainer = Trainer(recipe, SyntheticDataset(64, SEQ, seed=3))
    trainer.fit("/tmp/megamoe_test_cp_plan_tb")
    held = sum(t.numel() * t.element_size() for _, (_, state) in trainer.optimizer.owned_states().items()
               for k, t in state.items() if k != "step")
    planned = stage_memory(recipe.model, recipe.parallel, 2, 2, SEQ)
    return {"held": held, "planned": planned[0]["optim"]}


def test_planner_shards_optimizer_over_dp_cp(pool):
    """Both CP ranks together hold one copy of the AdamW state (ownership is greedy per parameter,
    so the halves differ a little); the plan says half a copy per rank."""
    got = pool(2).run(planned_vs_held_case)
    held, planned = sum(g["held"] for g in got), sum(g["planned"] for g in got)
    assert got[0]["planned"] == got[1]["planned"] and abs(planned - held) <= 1e-6 * held, got


def test_planner_long_context_rows_divide_activations_by_cp(monkeypatch):
    from megamoe.planning import activations
    from megamoe.planning.plan import LONG_CONTEXT, long_context_plan, stage_memory

    cfg = tiny_model("GeAd")
    one, two = (stage_memory(cfg, ParallelConfig(cp=cp), 8, 1, 1 << 20)[0] for cp in (1, 2))
    with monkeypatch.context() as m:  # without the mixers' CP factors: every token count halves
        m.setattr(activations, "CP_MIXER_FACTORS", {})
        plain = stage_memory(cfg, ParallelConfig(cp=2), 8, 1, 1 << 20)[0]
    assert plain["activations"] * 2 == one["activations"] > 0
    assert two["activations"] != plain["activations"]  # the factors apply
    assert two["weights"] == one["weights"] and two["optim"] == one["optim"]  # ZeRO-1 over dp*cp = 8 either way
    lines = long_context_plan(cfg, ParallelConfig(), 8).splitlines()
    assert lines[1].split() == ["tokens", "cp=1", "cp=2", "cp=4", "cp=8"]
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[2:]}
    assert list(rows) == ["128K", "256K", "512K", "1M"] and len(LONG_CONTEXT) == 4
    for cells in rows.values():
        assert all(a > b for a, b in zip(cells, cells[1:]))  # each CP doubling lowers the busiest rank


def cp_mixer_factor(letter: str, seq: int) -> float:
    """A CP=2 rank's saved activation bytes for ``letter`` over one process's for seq / 2 tokens."""
    from megamoe.diagnostics.memory import saved_tensor_bytes
    from megamoe.layers.spec import ForwardInfo
    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups
    from tests.mixer_utils import build_mixer, tiny_model as mixer_model

    cfg = mixer_model()  # the sizes the factors were measured at
    one = build_mixer(letter, cfg)
    x = torch.randn(2, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    half = x[:, :seq // 2].clone().requires_grad_(True)
    single = saved_tensor_bytes(lambda: one(half, ForwardInfo(positions=torch.arange(seq // 2).expand(2, -1)))
                                .sum().backward(), one.parameters())[0]
    groups = build_groups(ParallelConfig(cp=2))
    par = build_mixer(letter, cfg, groups, full_state={n: p.detach() for n, p in one.named_parameters()})
    shard = ContextShard(groups.cp, seq)
    local = shard.split(x).requires_grad_(True)
    info = ForwardInfo(positions=shard.split(torch.arange(seq).expand(2, -1)), cp=shard)
    return saved_tensor_bytes(lambda: par(local, info).sum().backward(), par.parameters())[0] / single


@pytest.mark.parametrize("letter", ["A", "G"])
def test_planner_cp_factors_are_measured(pool, letter):
    """The planner's CP factors (megamoe.planning.activations.CP_MIXER_FACTORS) for the default
    hybrid's two letters, measured again at the sizes of tests/mixer_utils.py: within 3%. (They
    move with the head widths.)"""
    from megamoe.planning.activations import CP_MIXER_FACTORS

    for got in pool(2).run(cp_mixer_factor, letter, 512):
        assert abs(got / CP_MIXER_FACTORS[letter] - 1) <= 0.03, (letter, got)


# ---- packed SFT samples ------------------------------------------------------------------------------

CHATS = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}],
         [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
         [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sky."}],
         [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye"}]]
PACK_LEN = 128


def write_chats(folder) -> str:
    import json

    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    return str(path)


def test_packed_sft_samples_keep_conversations_apart(tmp_path):
    from megamoe.data import ByteTokenizer, PackedSFTDataset, SFTDataset, build_dataset

    tok, path = ByteTokenizer(), write_chats(tmp_path)
    packed = build_dataset(DataConfig(kind="sft", paths=[path], seq_len=PACK_LEN, pack=True), tok)
    one = SFTDataset([path], tok, seq_len=PACK_LEN)
    assert isinstance(packed, PackedSFTDataset) and len(packed) < len(one)
    seen = 0
    for i in range(len(packed)):
        sample = packed[i]
        docs, pos = sample["documents"], sample["positions"]
        assert docs.shape == pos.shape == sample["input_ids"].shape == (PACK_LEN,)
        assert (docs.diff() >= 0).all()
        for d in docs.unique().tolist():
            where = (docs == d).nonzero().flatten()
            assert pos[where].tolist() == list(range(len(where)))  # positions restart at each document
            if seen < len(CHATS) and d < docs.max():  # a conversation: exactly its own unpacked sample
                n = len(one.tokenize(seen)[0])
                ref = one[seen]
                assert len(where) == n and sample["input_ids"][where].tolist() == ref["input_ids"][:n].tolist()
                assert sample["labels"][where].tolist() == ref["labels"][:n].tolist()
                assert sample["labels"][where[-1]] == -100  # no target crosses into the next one
                seen += 1
    assert seen == len(CHATS)
    with pytest.raises(ConfigError, match="^data.pack=True is invalid: only for kind=sft"):
        DataConfig(kind="synthetic", pack=True).validate()


def packed_step_case(path: str, cp: int, log_dir: str) -> dict:
    """The first step's loss of a trainer on packed samples (before any update), and the same
    weights' mean loss over the conversations run one by one as their own sequences."""
    from megamoe.data import build_dataset, collate
    from megamoe.model.language_model import LanguageModel
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.training.trainer import Trainer
    from megamoe.model.weights import initialize

    model_cfg = dataclasses.replace(tiny_model("GdSdAd"), vocab_size=256)
    data = DataConfig(kind="sft", paths=[path], seq_len=PACK_LEN, pack=True, shuffle=False)
    recipe = dataclasses.replace(tiny_recipe(ParallelConfig(cp=cp), steps=1), model=model_cfg, data=data)
    recipe.train.global_batch_size, recipe.train.micro_batch_size = 2, 1
    dataset = build_dataset(data)
    trainer = Trainer(recipe, dataset)
    loss = trainer.fit(log_dir)[0]["loss"]
    ref = LanguageModel(model_cfg, ParallelGroups())
    initialize(ref, ParallelGroups(), recipe.train.seed)
    total, count = 0.0, 0
    for i in range(2):
        sample = collate([dataset[i]])
        for d in sample["documents"].unique().tolist():
            keep = sample["documents"][0] == d
            labels = sample["labels"][:, keep]
            n = int((labels != -100).sum())
            if n:
                with torch.no_grad():
                    total += ref(sample["input_ids"][:, keep], labels=labels).item() * n
                count += n
    return {"trainer": loss, "one_by_one": total / count}


@pytest.mark.parametrize("cp", [1, 2])
def test_trainer_on_packed_samples_equals_conversations_one_by_one(pool, cp, tmp_path):
    for got in pool(cp).run(packed_step_case, write_chats(tmp_path), cp, str(tmp_path / "tb")):
        assert abs(got["trainer"] - got["one_by_one"]) <= 1e-5 * got["one_by_one"], got


# ---- the shell scripts' CP knob ----------------------------------------------------------------------

def test_pretrain_script_trains_with_the_cp_knob(tmp_path):
    """``NGPU=2 CP=2 bash pretrain_scripts/pretrain_hybrid_moe.sh``: torchrun, two CP ranks, the
    tiny hybrid MoE recipe (Gated DeltaNet, softmax attention, experts, two pipeline stages at
    pp=1), two steps and a checkpoint."""
    import json
    import subprocess
    from pathlib import Path

    from tests.dist import script_env

    repo = Path(__file__).resolve().parent.parent
    env = script_env(tmp_path, NGPU="2", CP="2")
    out = subprocess.run(["bash", "pretrain_scripts/pretrain_hybrid_moe.sh", "train.steps=2", "logging.interval=1",
                          f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}",
                          "logging.progress=false"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "parallel.cp=2" in out.stdout
    losses = [json.loads(line)["loss"] for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(5.0 < x < 6.5 for x in losses), losses  # ~ln(320) at the start
    assert (tmp_path / "ckpt" / "step_00000002").is_dir()


# ---- a vision-language model -------------------------------------------------------------------------

def straddling_batch():
    """Two images across chunk borders at CP=2 (chunks of 6 tokens: rank 0 holds [0, 6) and
    [18, 24), rank 1 [6, 18)): 6 tokens at [3, 9) in sample 0, 4 tokens at [16, 20) in sample 1."""
    from tests.test_multimodal import IMG

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 60, (3, 24), generator=gen)
    ids[0, 3:9] = IMG
    ids[1, 16:20] = IMG
    return ids, [torch.randn(3, h, w, generator=gen) for h, w in ((48, 32), (32, 32))]


def multimodal_case(parallel: dict, sp: bool, straddle: bool = False) -> tuple[dict, int, int]:
    """Relative errors of logits, loss and every gradient (vision tower included) of a tiny VLM with
    M-RoPE at ``parallel`` against one process, how many images this rank's tower encoded in one
    forward (only those with a token in its chunks) and its CP rank."""
    from megamoe.model.language_model import shift_labels
    from megamoe.parallel.groups import build_groups
    from megamoe.training.grads import sync_grads
    from tests.mixer_utils import param_grad_errors
    from tests.test_multimodal import batch, build, tiny_mm

    groups = build_groups(ParallelConfig(**parallel))
    ref, model = build(tiny_mm("GdAd", gdn=GDN), 0), build(tiny_mm("GdAd", gdn=GDN), 0, groups, sequence_parallel=sp)
    ids, images = straddling_batch() if straddle else batch(0)
    encoded = []
    model.vision.register_forward_pre_hook(lambda mod, args: encoded.append(len(args[0])))
    labels = shift_labels(ids)
    with torch.no_grad():
        logits = model.sequence_shard(ids.size(1)).gather(model(ids, images), 1)
        errs = {"logits": rel_err(logits, ref(ids, images))}
    loss, ref_loss = model(ids, images, labels=labels), ref(ids, images, labels=labels)
    errs["loss"] = rel_err(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    sync_grads([model], groups)
    return param_grad_errors(ref, model, groups, errs), encoded[0], groups.rank("cp")


GDN = GDNConfig(num_key_heads=2, num_value_heads=2, key_head_dim=8, value_head_dim=8, chunk_size=8)


@pytest.mark.parametrize("n,parallel,sp,straddle", [(2, dict(cp=2), False, False), (4, dict(cp=2, tp=2), True, False),
                                                    (2, dict(cp=2), False, True)],
                         ids=["cp2", "cp2-tp2-sp", "cp2-images-across-chunks"])
def test_multimodal_model_matches_single(pool, n, parallel, sp, straddle):
    results = pool(n).run(multimodal_case, parallel, sp, straddle)
    for rank, (errs, _, _) in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: relative errors over 1e-5: {bad}"
    # batch(0)'s images sit at [2, 6) and [8, 14) of sample 0 and [0, 4) of sample 1: CP rank 0 (tokens
    # [0, 6) and [18, 24)) encodes two, rank 1 ([6, 18)) one; an image across a border: both ranks
    expected = [2, 2] if straddle else [2, 1]
    assert [enc for _, enc, _ in results] == [expected[cp] for _, _, cp in results]
    results = [errs for errs, _, _ in results]
    assert sum(k.startswith("grad vision.") for k in results[0]) > 20  # every vision gradient compared
