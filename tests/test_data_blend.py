"""Megatron's data in megamoe: indexed datasets (.bin/.idx) read and written through megatron-core,
weighted blends in Megatron's ``[w1, path1, w2, path2]`` form, and the held-out validation split."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megamoe.data import (Blend, ByteTokenizer, DataConfig, IndexedTokens, PackedDataset, TokenFile, build_datasets,
                          build_train_data, holdout, parse_blend)
from megamoe.data.blend import blend_assign
from megamoe.core.errors import ConfigError, DataError

TOK = ByteTokenizer()


def megatron_builder(prefix: Path, docs: list[np.ndarray], dtype) -> None:
    """Write ``docs`` with megatron-core's own builder, one sequence per document."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def random_docs(n: int, seed: int, vocab: int = 250, eos: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(6, vocab, int(rng.integers(3, 40))), eos).astype(np.int64) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_builder_tokens_read_back_exactly(tmp_path, dtype):
    """Tokens of a .bin/.idx pair written by megatron-core's builder, read as megamoe's stream and
    its windows, equal what was written; document starts come from the index."""
    docs = random_docs(60, 1)
    megatron_builder(tmp_path / "corpus", docs, dtype)
    stream = np.concatenate(docs)
    src = IndexedTokens(tmp_path / "corpus", TOK)
    assert src.num_tokens == len(stream) and src.num_documents == 60 and src.dtype == np.dtype(dtype)
    assert np.array_equal(src.read(0, len(stream)), stream)
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    assert [src.document_start(d) for d in range(61)] == starts.tolist()
    assert src.doc_start_at_or_after(starts[7] + 1) == starts[8] and src.doc_start_at_or_after(starts[7]) == starts[7]
    ds = PackedDataset([tmp_path / "corpus"], 16, TOK, reset_at_eos=True, eos_mask_loss=True)
    assert len(ds) == (len(stream) - 1) // 16
    for j in (0, 5, len(ds) - 1):
        w = stream[j * 16: j * 16 + 17]
        assert torch.equal(ds[j]["input_ids"], torch.from_numpy(w[:-1]))
        assert torch.equal(ds[j]["labels"], torch.from_numpy(np.where(w[:-1] == 2, -100, w[1:])))


def test_prepare_data_megatron_format_writes_what_megatron_reads(tmp_path):
    """``megamoe-prepare-data --format megatron``: megatron-core's IndexedDataset reads one
    document per record, each ending with EOS, equal to the token directory of the same input."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megamoe.commands.cli import run_main
    from megamoe.commands import prepare_data

    text = tmp_path / "a.jsonl"
    text.write_text("".join(json.dumps({"text": f"document number {i} " * (i % 5 + 1)}) + "\n" for i in range(30)))
    run_main(prepare_data.main, ["--format", "megatron", "--tokenizer", "byte", "--no-progress", "--output",
                                 str(tmp_path / "mg" / "corpus"), str(text)])
    run_main(prepare_data.main, ["--tokenizer", "byte", "--no-progress", "--output", str(tmp_path / "c.tokens"),
                                 str(text)])
    theirs = IndexedDataset(str(tmp_path / "mg" / "corpus"))
    ref = TokenFile(tmp_path / "c.tokens")  # the token directory of the same input
    assert len(theirs) == ref.num_documents == 30
    for d in range(30):
        assert theirs[d].tolist() == ref.document(d).tolist() and theirs[d][-1] == TOK.eos_id
    assert sorted(p.name for p in (tmp_path / "mg").iterdir()) == ["corpus.bin", "corpus.idx"]
    with pytest.raises(SystemExit) as e:  # an existing output is refused, and nothing else is written
        run_main(prepare_data.main, ["--format", "megatron", "--tokenizer", "byte", "--no-progress", "--output",
                                     str(tmp_path / "mg" / "corpus"), str(text)])
    assert e.value.code == 2 and sorted(p.name for p in (tmp_path / "mg").iterdir()) == ["corpus.bin", "corpus.idx"]


def test_indexed_dataset_errors_are_one_line(tmp_path):
    docs = random_docs(5, 2, vocab=400)
    megatron_builder(tmp_path / "c", docs, np.uint16)
    with pytest.raises(DataError, match="token id .* outside the tokenizer's vocab_size=262"):
        PackedDataset([tmp_path / "c"], 8, TOK)[0]  # ids up to 399 against the byte tokenizer's 262
    no_eos = [d[:-1] for d in random_docs(5, 3)]
    megatron_builder(tmp_path / "n", no_eos, np.uint16)
    with pytest.raises(DataError, match="document 0 does not end with EOS id 2"):
        PackedDataset([tmp_path / "n"], 8, TOK, reset_at_eos=True)
    (tmp_path / "t.bin").write_bytes(b"\0" * 10)
    (tmp_path / "t.idx").write_bytes(b"not an index")
    with pytest.raises(DataError, match="t.idx: not a Megatron indexed dataset"):
        IndexedTokens(tmp_path / "t")
    (tmp_path / "c.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:-4])  # truncated
    with pytest.raises(DataError, match="c.bin: .* bytes do not match its index"):
        IndexedTokens(tmp_path / "c")
    with pytest.raises(DataError, match="neither a token directory nor a Megatron indexed dataset prefix"):
        PackedDataset([tmp_path / "missing"], 8, TOK)


# ---- blending ---------------------------------------------------------------------------------

def test_parse_blend_megatron_form():
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    for bad, why in ((["0.3", "a", "b"], "alternates"), (["a", "0.5"], "does not start"),
                     (["0", "a", "1", "b"], "> 0"), (["-1 a"], "> 0")):
        with pytest.raises(ConfigError, match=why):
            parse_blend(bad)
    with pytest.raises(ConfigError, match=r"data.paths=\['a', '0.5'\] is invalid"):
        DataConfig(paths=["a", "0.5"]).validate()


def test_blend_assignment_proportions_and_bijection():
    weights = [0.2, 0.5, 0.3]
    which, position = blend_assign(np.arange(10_000), weights)
    share = np.bincount(which, minlength=3) / 10_000
    assert np.abs(share - weights).max() <= 0.01, share
    for prefix in (7, 100, 999, 5003):  # every prefix, within a sample per tree level
        counts = np.bincount(which[:prefix], minlength=3)
        assert np.abs(counts - prefix * np.array(weights)).max() <= 2, (prefix, counts)
    for d in range(3):  # the k-th sample of dataset d is its k-th: 0, 1, 2, ... in order
        assert np.array_equal(position[which == d], np.arange((which == d).sum()))
    # a sample's assignment does not depend on which others are computed with it
    some = np.array([9999, 3, 5000, 12])
    w2, p2 = blend_assign(some, weights)
    assert np.array_equal(w2, which[some]) and np.array_equal(p2, position[some])


@pytest.fixture(scope="module")
def three_corpora(tmp_path_factory) -> list[Path]:
    """Three indexed datasets of 39, 89 and 24 windows of 8 tokens, each made of its corpus letter (and EOS)."""
    root = tmp_path_factory.mktemp("blend")
    out = []
    for c, n in zip("abc", (40, 90, 25)):
        docs = [np.array([ord(c)] * 7 + [TOK.eos_id], dtype=np.int64) for _ in range(n)]
        megatron_builder(root / c, docs, np.uint16)
        out.append(root / c)
    return out


def corpus_of(batches: list[dict]) -> list[str]:
    return [chr(int(row.max())) for b in batches for row in b["input_ids"]]


def test_blend_proportions_identical_at_dp1_and_dp2_and_resumable(three_corpora):
    """10,000 samples of a 0.2/0.5/0.3 blend: each corpus within 1% of its weight; the global
    batches at DP=2 (and at another micro-batch size) are those of DP=1; a run resumed mid-epoch
    continues exactly; each corpus repeats its windows per its own epochs."""
    paths = [x for w, p in zip(("0.2", "0.5", "0.3"), three_corpora) for x in (w, str(p))]
    cfg = DataConfig(paths=paths, seq_len=8, seed=11)
    train, _ = build_datasets(cfg, TOK)
    assert isinstance(train, Blend) and train.sizes == [39, 89, 24]
    G, steps = 100, 100
    one = build_train_data(cfg, global_batch_size=G, micro_batch_size=25, dataset=train)
    batches = [one(k * G) for k in range(steps)]
    letters = sum((corpus_of(b) for b in batches), [])
    share = {c: letters.count(c) / len(letters) for c in "abc"}
    assert len(letters) == 10_000 and all(abs(share[c] - w) <= 0.01 for c, w in zip("abc", (0.2, 0.5, 0.3))), share
    items = [one.step_indices(k * G) for k in range(steps)]
    for micro in (10, 50):
        ranks = [build_train_data(cfg, global_batch_size=G, micro_batch_size=micro, dp_rank=r, dp_size=2, dataset=train)
                 for r in range(2)]
        for k in (0, 37, 99):
            assert np.array_equal(np.concatenate([i for data in ranks for i in data.step_indices(k * G)]),
                                  np.concatenate(items[k])), (micro, k)
            assert sum((corpus_of(data(k * G)) for data in ranks), []) == corpus_of(batches[k])
    resumed = build_train_data(cfg, global_batch_size=G, micro_batch_size=20, consumed_samples=37 * G, dataset=train)
    for k in range(37, 40):
        assert np.array_equal(np.concatenate(resumed.step_indices(k * G)), np.concatenate(items[k]))
    flat = np.concatenate([np.concatenate(i) for i in items])
    a = flat[flat < 39]  # corpus a's items: every window once per epoch of its 39
    assert len(a) // 39 >= 50 and all(sorted(a[e * 39:(e + 1) * 39].tolist()) == list(range(39))
                                      for e in range(len(a) // 39))


# ---- validation split ---------------------------------------------------------------------------

def test_holdout_is_disjoint_deterministic_and_cut_at_documents(tmp_path, three_corpora):
    docs = random_docs(80, 4)
    megatron_builder(tmp_path / "c", docs, np.uint16)
    starts = set(np.concatenate([[0], np.cumsum([len(d) for d in docs])]).tolist())
    full = PackedDataset([tmp_path / "c"], 16, TOK)
    train, valid = holdout(full, 0.1)
    (tr,), (va,) = train.streams, valid.streams
    assert tr.begin == 0 and tr.end == va.begin and va.end == full.streams[0].end and va.begin in starts
    assert abs(va.begin - 0.9 * va.end) <= 40  # the first document start after 90% of the tokens
    assert (len(train) - 1) * 16 + 16 < va.begin  # the last training window ends before validation starts
    again = holdout(full, 0.1)[1]
    assert len(again) == len(valid) and all(np.array_equal(again.window(i), valid.window(i)) for i in range(len(valid)))
    assert np.array_equal(valid.window(0), full.streams[0].source.read(va.begin, 17))
    # a blend is cut per corpus and keeps its weights; records are cut by record
    paths = [x for w, p in zip(("1", "2", "1"), three_corpora) for x in (w, str(p))]
    blend_train, blend_valid = build_datasets(DataConfig(paths=paths, seq_len=8), TOK, eval_split=0.2)
    assert blend_valid.weights == blend_train.weights == [0.25, 0.5, 0.25]
    assert [len(d) for d in blend_valid.datasets] == [7, 17, 4] and [len(d) for d in blend_train.datasets] == [31, 71, 19]
    sub_train, sub_valid = holdout(list(range(10)), 0.3)
    assert list(sub_train) == list(range(7)) and list(sub_valid) == [7, 8, 9]
    with pytest.raises(DataError, match="eval.split=0.5 leaves"):
        holdout(PackedDataset([tmp_path / "c"], 1000, TOK), 0.5)
