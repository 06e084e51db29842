"""Pretraining windows with documents kept apart (``data.reset_at_eos``, ``data.eos_mask_loss``):
the dataset's documents, positions and labels on a hand-made token file and against
Megatron-Core's ``_get_ltor_masks_and_position_ids``; a hybrid model (G, K, L, A, S, M mixers,
dense and MoE MLPs) on a packed window equals its documents run one by one (logits, loss, every
gradient; fp32, 1e-5) in one process and at CP=2; the trainer through the loader at CP=1, CP=2
and PP=2; bad configuration as one line naming the field."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe.core.config import MoEConfig, ParallelConfig
from megamoe.data import ByteTokenizer, DataConfig, PackedDataset, build_dataset, write_token_file
from megamoe.core.errors import ConfigError, DataError
from tests.mixer_utils import tiny_model
from tests.numerics import rel_err

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5
TEXTS = ["abc", "de", "fghij", "k", "lmnop"]
# G, K, L | A, S, M; dense MLPs and a MoE one (balancing losses off: they see the whole batch)
LAYOUT = "GdKeLd|AdSeMd"
MOE = MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, num_shared_experts=1, aux_loss_coeff=0.0,
                seq_aux_loss_coeff=0.0, z_loss_coeff=0.0)


def token_file(tmp_path: Path, texts=TEXTS) -> Path:
    (tmp_path / "docs.txt").write_text("\n".join(texts) + "\n")
    write_token_file([tmp_path / "docs.txt"], tmp_path / "docs.tokens", ByteTokenizer(), fmt="lines", progress=False)
    return tmp_path / "docs.tokens"


# ---- the dataset -------------------------------------------------------------------------------

def test_windows_documents_positions_labels_by_hand(tmp_path):
    """Stream a b c E d e E f g h i j E k E l m n o p E (21 tokens), windows of 8 + 1."""
    path = token_file(tmp_path)
    tok, X = ByteTokenizer(), -100
    ids = lambda s: [tok.eos_id if c == "E" else tok.encode(c)[0] for c in s]  # noqa: E731
    plain = PackedDataset([path], 8, ByteTokenizer())
    ds = build_dataset(DataConfig(kind="pretrain", paths=[str(path)], seq_len=8, reset_at_eos=True,
                                  eos_mask_loss=True))
    assert len(ds) == len(plain) == 2 and set(plain[0]) == {"input_ids", "labels"}
    assert ds[0]["input_ids"].tolist() == ids("abcEdeEf")
    assert plain[0]["labels"].tolist() == ids("bcEdeEfg")
    assert ds[0]["labels"].tolist() == ids("bcE") + [X] + ids("eE") + [X] + ids("g")  # no target at an EOS input
    assert ds[0]["documents"].tolist() == [0, 0, 0, 0, 1, 1, 1, 2]  # the EOS ends its document
    assert ds[0]["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    # a window starts inside a document: it is document 0 of the window, from position 0
    assert ds[1]["input_ids"].tolist() == ids("ghijEkEl")
    assert ds[1]["labels"].tolist() == ids("hijE") + [X] + ids("E") + [X] + ids("m")
    assert ds[1]["documents"].tolist() == [0, 0, 0, 0, 0, 1, 1, 2]
    assert ds[1]["positions"].tolist() == [0, 1, 2, 3, 4, 0, 1, 0]
    only_reset = PackedDataset([path], 8, ByteTokenizer(), reset_at_eos=True)
    assert only_reset[1]["labels"].tolist() == plain[1]["labels"].tolist()  # targets untouched
    assert only_reset[1]["documents"].tolist() == ds[1]["documents"].tolist()
    only_mask = PackedDataset([path], 8, eos_mask_loss=True)  # EOS from the file's header
    assert only_mask[1]["labels"].tolist() == ds[1]["labels"].tolist() and "documents" not in only_mask[1]


@pytest.mark.parametrize("seq_len", [3, 4, 7])
def test_windows_match_megatron_reset_and_eod_mask(tmp_path, seq_len):
    """Megatron-Core's masks for --reset-position-ids --reset-attention-mask --eod-mask-loss on
    the same tokens: equal positions, loss mask = labels != -100, and its attention mask is
    exactly "same document and causal" (windows starting with EOS included)."""
    from megamoe.data.samples import collate

    gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    ds = PackedDataset([token_file(tmp_path)], seq_len, ByteTokenizer(), reset_at_eos=True, eos_mask_loss=True)
    for i in range(len(ds)):
        s = ds[i]
        mask, loss_mask, positions = gpt._get_ltor_masks_and_position_ids(
            s["input_ids"], 2, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
            create_attention_mask=True)
        assert s["positions"].tolist() == positions.tolist(), i
        assert (s["labels"] != -100).float().tolist() == loss_mask.tolist(), i
        docs = s["documents"]
        allowed = (docs[:, None] == docs[None, :]) & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        assert torch.equal(~mask[0], allowed), i  # Megatron's mask is True where attention is blocked
    assert collate([ds[0], ds[1]])["documents"].shape == (2, seq_len)


# ---- the model: a packed window equals its documents one by one ------------------------------

def window_batch(tmp_path: Path) -> dict:
    """Two windows of 32 tokens over documents of 3..17 bytes, each window cutting a document."""
    from megamoe.data.samples import collate

    texts = ["the cat", "sat on a warm mat", "ok", "then it slept", "a dog came by", "end of it", "zz",
             "quick brown fox", "jumps"]
    ds = PackedDataset([token_file(tmp_path, texts)], 32, ByteTokenizer(), reset_at_eos=True, eos_mask_loss=True)
    batch = collate([ds[0], ds[1]])
    assert batch["documents"].max() >= 2 and batch["positions"][:, 0].tolist() == [0, 0]
    return batch


def model_config():
    return dataclasses.replace(tiny_model(LAYOUT, vocab_size=ByteTokenizer().vocab_size), moe=MOE)


def one_by_one(batch: dict, seed: int) -> dict:
    """Every document of every row run alone as its own sequence (positions from 0), one process:
    logits [b, S, V] put back in place, the summed loss and every gradient."""
    from megamoe.model.language_model import LanguageModel
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.model.weights import initialize

    model = LanguageModel(model_config(), ParallelGroups())
    initialize(model, ParallelGroups(), seed)
    logits, loss = [], torch.zeros(())
    for r in range(batch["input_ids"].size(0)):
        docs = batch["documents"][r]
        for d in docs.unique().tolist():
            keep = docs == d
            out = model.forward_stage(batch["input_ids"][r:r + 1, keep])
            loss = loss + model.loss_sum(out, batch["labels"][r:r + 1, keep])
            logits.append(out[0])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    s = batch["input_ids"].size(1)
    return {"logits": torch.cat(logits).view(-1, s, logits[0].size(-1)), "loss": loss.detach(), "grads": grads}


def packed_case(batch: dict, seed: int, cp: int) -> dict:
    """The packed rows through one model (CP=``cp`` when > 1): gathered logits, the summed loss
    over all CP ranks and every gradient synchronised as the trainer does; plus the same rows
    without ``documents``/``positions`` (to show the documents do interact when not kept apart)."""
    from megamoe.model.language_model import LanguageModel
    from megamoe.parallel import comm
    from megamoe.parallel.groups import ParallelGroups, build_groups
    from megamoe.training.grads import sync_grads
    from megamoe.model.weights import initialize

    groups = build_groups(ParallelConfig(cp=cp)) if cp > 1 else ParallelGroups()
    model = LanguageModel(model_config(), groups)
    initialize(model, groups, seed)
    ids, labels = batch["input_ids"], batch["labels"]
    out = model.forward_stage(ids, positions=batch["positions"], documents=batch["documents"])
    loss = comm.reduce_from(model.loss_sum(out, labels), groups.cp)
    loss.backward()
    sync_grads([model], groups)
    shard = model.sequence_shard(ids.size(1))
    gather = (lambda t: shard.gather(t, 1)) if shard is not None else (lambda t: t)
    with torch.no_grad():
        plain = gather(model.forward_stage(ids))
    return {"logits": gather(out.detach()), "loss": loss.detach(), "plain": plain,
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def check_equal(got: dict, ref: dict, what: str) -> None:
    assert rel_err(got["logits"], ref["logits"]) <= TOL, (what, rel_err(got["logits"], ref["logits"]))
    assert rel_err(got["loss"], ref["loss"]) <= TOL, (what, got["loss"], ref["loss"])
    assert got["grads"].keys() == ref["grads"].keys() and len(ref["grads"]) > 40, what
    for name, g in ref["grads"].items():
        assert rel_err(got["grads"][name], g) <= TOL, (what, name, rel_err(got["grads"][name], g))
    assert rel_err(got["plain"], ref["logits"]) > 1e-3, what  # without documents they do leak


def test_packed_window_equals_documents_one_by_one(tmp_path):
    batch = window_batch(tmp_path)
    check_equal(packed_case(batch, 3, 1), one_by_one(batch, 3), "one process")


def cp_case(batch: dict, seed: int) -> dict:
    got = packed_case(batch, seed, 2)
    check_equal(got, one_by_one(batch, seed), f"cp=2 rank {torch.distributed.get_rank()}")
    return {}


def test_packed_window_at_cp2_equals_documents_one_by_one(pool, tmp_path):
    pool(2).run(cp_case, window_batch(tmp_path), 3)


# ---- the trainer through the loader -------------------------------------------------------------

def trainer_case(path: str, parallel: dict, log_dir: str) -> dict:
    """Three trainer steps on packed windows (loader, reset_at_eos, eos_mask_loss); the first
    step's loss (before any update) also from the documents run one by one."""
    from megamoe.data.samples import collate
    from megamoe.model.language_model import LanguageModel
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.training.config import LoggingConfig, OptimConfig, TrainConfig
    from megamoe.recipe import Recipe as TrainRecipe
    from megamoe.training.trainer import Trainer
    from megamoe.model.weights import initialize

    data = DataConfig(kind="pretrain", paths=[path], seq_len=32, shuffle=False, reset_at_eos=True,
                      eos_mask_loss=True)
    recipe = TrainRecipe(model=model_config(), parallel=ParallelConfig(**parallel), data=data,
                         train=TrainConfig(steps=3, micro_batch_size=1, global_batch_size=2, seed=1),
                         optim=OptimConfig(lr=1e-3, warmup_steps=0),
                         logging=LoggingConfig(progress=False, latency_interval=0))
    dataset = build_dataset(data)
    losses = [h["loss"] for h in Trainer(recipe, dataset).fit(log_dir)]
    ref = LanguageModel(model_config(), ParallelGroups())
    initialize(ref, ParallelGroups(), recipe.train.seed)
    batch = collate([dataset[0], dataset[1]])
    total, count = 0.0, 0
    with torch.no_grad():
        for r in range(2):
            for d in batch["documents"][r].unique().tolist():
                keep = batch["documents"][r] == d
                labels = batch["labels"][r:r + 1, keep]
                total += ref.loss_sum(ref.forward_stage(batch["input_ids"][r:r + 1, keep]), labels).item()
                count += int((labels != -100).sum())
    return {"losses": losses, "one_by_one": total / count}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    texts = [("word " * (3 + 5 * i % 11)).strip() for i in range(40)]
    return str(token_file(tmp_path_factory.mktemp("corpus"), texts))


@pytest.fixture(scope="module")
def single_run(pool, corpus, tmp_path_factory):
    return pool(1).run(trainer_case, corpus, {}, str(tmp_path_factory.mktemp("tb")))[0]


def test_trainer_on_packed_windows_equals_documents_one_by_one(single_run):
    got = single_run
    assert abs(got["losses"][0] - got["one_by_one"]) <= TOL * got["one_by_one"], got
    assert got["losses"][2] < got["losses"][0]


@pytest.mark.parametrize("parallel", [dict(cp=2), dict(pp=2)], ids=["cp2", "pp2"])
def test_trainer_on_packed_windows_parallel(pool, corpus, single_run, parallel, tmp_path):
    for got in pool(2).run(trainer_case, corpus, parallel, str(tmp_path / "tb")):
        assert abs(got["losses"][0] - got["one_by_one"]) <= TOL * got["one_by_one"], (parallel, got)
        for mine, ref in zip(got["losses"], single_run["losses"]):
            assert abs(mine - ref) <= TOL * ref, (parallel, got["losses"], single_run["losses"])


# ---- bad configuration: one line naming the field ----------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(kind="pretrain", pack=True), "data.pack=True is invalid: only for kind=sft (pretraining windows: "
                                       "data.reset_at_eos=true keeps their documents apart)"),
    (dict(kind="sft", reset_at_eos=True), "data.reset_at_eos=True is invalid: only for kind=pretrain "
                                          "(sft: data.pack=true packs conversations as documents)"),
    (dict(kind="synthetic", eos_mask_loss=True), "data.eos_mask_loss=True is invalid: only for kind=pretrain"),
    (dict(kind="pretrain", reset_at_eos="yes"), "data.reset_at_eos='yes' is invalid: must be true or false"),
])
def test_bad_config_is_one_line(kw, message):
    with pytest.raises(ConfigError) as e:
        DataConfig(paths=["x.tokens"], **kw).validate()
    assert str(e.value) == message


def test_token_files_without_one_eos_are_one_line(tmp_path):
    import json

    path = token_file(tmp_path)
    header = json.loads((path / "header.json").read_text())
    header["append_eos"] = False  # a token file whose documents do not end with EOS
    (path / "header.json").write_text(json.dumps(header))
    assert len(PackedDataset([path], 8)) == 2  # fine as plain windows
    with pytest.raises(DataError) as e:
        PackedDataset([path], 8, reset_at_eos=True)
    assert str(e.value) == (f"{path}: header does not say which EOS ends each document (tokenizer.eos_id, "
                            "append_eos); data.reset_at_eos and data.eos_mask_loss need it")
    header.update(append_eos=True, tokenizer={**header["tokenizer"], "eos_id": 7})  # another tokenizer's EOS
    (path / "header.json").write_text(json.dumps(header))
    (tmp_path / "b").mkdir()
    other = token_file(tmp_path / "b")
    with pytest.raises(DataError) as e:
        PackedDataset([path, other], 8, eos_mask_loss=True)
    assert str(e.value) == f"{path}, {other}: documents end with different EOS ids [2, 7]"


def test_pretrain_cli_refuses_reset_at_eos_for_synthetic_data():
    out = subprocess.run([sys.executable, "tools/pretrain.py", "--config", "tiny_hybrid_moe",
                          "data.reset_at_eos=true"], cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith(("W1", "/", "  warnings"))]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines == ["error: data.reset_at_eos=True is invalid: only for kind=pretrain"], lines


def test_gdn_on_one_sequence_of_exactly_one_chunk():
    """A document of exactly ``chunk_size`` tokens run alone (batch 1, one chunk) equals the same
    tokens as a row of a batch of two (the op once failed there on a non-contiguous view)."""
    from tests.mixer_utils import build_mixer, full_forward

    cfg = model_config()
    mixer = build_mixer("G", cfg)
    x = torch.randn(2, cfg.gdn.chunk_size, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    alone = x[:1].clone().requires_grad_(True)
    both = x.clone().requires_grad_(True)
    full_forward(mixer, alone).square().sum().backward()
    full_forward(mixer, both)[:1].square().sum().backward()
    assert rel_err(alone.grad, both.grad[:1]) <= TOL and both.grad[1].abs().max() == 0


def test_pretrain_script_data_knobs(corpus, tmp_path):
    """``DATA=... RESET_AT_EOS=1 EOS_MASK_LOSS=1 bash pretrain_scripts/pretrain_hybrid_moe.sh``:
    torchrun trains the tiny hybrid MoE recipe one step on the token file, documents apart."""
    import json

    from tests.dist import script_env

    env = script_env(tmp_path, DATA=corpus, RESET_AT_EOS="1", EOS_MASK_LOSS="1")
    out = subprocess.run(["bash", "pretrain_scripts/pretrain_hybrid_moe.sh", "train.steps=1", "train.global_batch_size=4",
                          "train.micro_batch_size=2", f"logging.dir={tmp_path / 'tb'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                          "logging.progress=false"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"data.kind=pretrain data.paths=[{corpus}] data.reset_at_eos=true data.eos_mask_loss=true"
            in out.stdout), out.stdout
    assert "token file(s); documents kept apart after every EOS (id 2), no loss at EOS inputs" in out.stderr
    recipe = (tmp_path / "tb" / "recipe.yaml").read_text()
    assert "reset_at_eos: true" in recipe and "eos_mask_loss: true" in recipe and "kind: pretrain" in recipe
    losses = [json.loads(line)["loss"] for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 1 and 5.0 < losses[0] < 6.5, losses  # ~ln(320) at the start
    assert (tmp_path / "ckpt" / "step_00000001").is_dir()
