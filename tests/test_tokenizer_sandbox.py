"""Tokenizers and chat templates as checkpoints ship them, run without their code:

- a tiktoken folder (Kimi's format: ``tiktoken.model`` BPE ranks + ``tokenizer_config.json``)
  encodes and decodes text with special tokens exactly as the ``tiktoken`` package does with the
  same ranks, specials and Kimi's pattern; a BPE rank file is trained here with tiktoken's own
  trainer (no download);
- chat templates render in a bounded sandbox: templates reaching for Python internals or
  running away in time or size are refused with one line, quickly.
"""
from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest

from megamoe.data.chat import ChatTemplate, ChatTemplateError, resolve_template
from megamoe.core.errors import DataError

CORPUS = ("Hello world, it's a small corpus. The quick brown fox jumps over the lazy dog; "
          "你好世界，我们训练一个很小的分词器。 Numbers 12345 and 678 go in threes.\n") * 6
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_start|>", 3: "<|im_end|>"}  # offsets past the BPE ranks
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiktoken_dir(tmp_path_factory) -> Path:
    """A folder laid out as Kimi's: ranks trained on CORPUS (300 tokens), reserved specials."""
    pytest.importorskip("tiktoken")  # installed with megamoe (setup.py); the sandbox tests need none
    from tiktoken._educational import bpe_train

    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    ranks = bpe_train(CORPUS, 300, pattern, visualise=None)
    path = tmp_path_factory.mktemp("kimi_tok")
    lines = [base64.b64encode(tok) + b" " + str(rank).encode()
             for tok, rank in sorted(ranks.items(), key=lambda x: x[1])]
    (path / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    n = len(ranks)
    config = {"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"},
              "added_tokens_decoder": {str(n + k): {"content": v, "special": True} for k, v in SPECIALS.items()},
              "chat_template": TEMPLATE, "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def reference_encoding(path: Path):
    """The tiktoken Encoding Kimi's own tokenizer code builds from the same folder."""
    import tiktoken

    from megamoe.data.bpe_ranks import KIMI_PATTERN

    ranks = {}
    for line in (path / "tiktoken.model").read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    named = {int(k): v["content"] for k, v in json.loads((path / "tokenizer_config.json").read_text())
             ["added_tokens_decoder"].items()}
    n = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding(name="kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_tiktoken_folder_encodes_and_decodes_as_tiktoken(tiktoken_dir):
    from megamoe.data.tokenizer import TiktokenTokenizer, load_tokenizer

    tok = load_tokenizer(tiktoken_dir)
    ref = reference_encoding(tiktoken_dir)
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == ref.n_vocab == 300 + 256
    text = "[BOS]<|im_start|>user\nHello 世界, it's 2025!\tOK<|im_end|><|im_start|>assistant\nFine.[EOS]"
    ids = tok.encode(text)
    assert ids == ref.encode(text, allowed_special="all") and tok.decode(ids) == ref.decode(ids) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (300, 301, 301) and ids[0] == 300 and ids[-1] == 301
    assert tok.token_to_id("<|im_end|>") == 303 and tok.token_to_id("<|reserved_token_555|>") == 555
    assert tok.decode([1 << 20]) == "\ufffd"  # an id past the tokenizer (padded vocab)
    # Kimi's pattern: Han runs and cased words are pieces of their own
    assert [ref.decode([i]) for i in ref.encode("你好World")][0] != "你好World"
    template = resolve_template(None, tok)
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\n"


def test_tiktoken_folder_errors_are_one_line(tiktoken_dir, tmp_path):
    from megamoe.data.tokenizer import load_tokenizer

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tiktoken.model").write_bytes((tiktoken_dir / "tiktoken.model").read_bytes() + b"not-base64!! x\n")
    (bad / "tokenizer_config.json").write_text((tiktoken_dir / "tokenizer_config.json").read_text())
    with pytest.raises(DataError, match=r"tiktoken.model:301: expected 'base64-token rank'") as err:
        load_tokenizer(bad)
    assert "\n" not in str(err.value)
    (bad / "tiktoken.model").write_bytes((tiktoken_dir / "tiktoken.model").read_bytes())
    config = json.loads((tiktoken_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|nowhere|>"
    (bad / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match="eos_token is missing or not a special token"):
        load_tokenizer(bad)


INTERNALS = [  # server-side template injection payloads: refused by the sandbox
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ self.__init__.__globals__.__builtins__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = messages.append(1) %}{{ messages }}",
    "{{ messages[0].update({'role': 'x'}) }}",
]
RUNAWAY = [  # bounded in time or size: refused before they take the machine
    "{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}done",
    "{{ 'x' * 1000000000 }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "{{ 9 ** 999999 }}",
    "{% set ns = namespace(n=2 ** 16) %}{% for i in range(9) %}{% set ns.n = ns.n ** 64 %}{% endfor %}{{ ns.n }}",
    "{% macro m(n) %}{{ m(n) }}{{ m(n) }}{% endmacro %}{{ m(1) }}",
    "{{ '%999999999s' % 'x' }}",
    "{{ 'x'|center(999999999) }}",
    "{{ range(1000000000)|list|length }}",
    "{% for i in range(60000) %}{{ 'y' * 60000 }}{% endfor %}",
]


@pytest.mark.parametrize("source", INTERNALS)
def test_template_reaching_for_python_internals_is_refused_or_inert(source):
    """Refused with one line, or inert: the unsafe attribute reads as undefined and renders
    nothing; the messages are never modified."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        out = ChatTemplate(source, name="from a checkpoint").render(messages)
    except ChatTemplateError as err:
        assert str(err).startswith("chat template from a checkpoint: ") and "\n" not in str(err)
    else:
        assert out.strip() == "", out
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source", RUNAWAY)
def test_runaway_template_is_refused_quickly(source):
    t = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"^chat template from a checkpoint: ") as err:
        ChatTemplate(source, name="from a checkpoint").render([{"role": "user", "content": "hi"}])
    assert "\n" not in str(err.value) and time.monotonic() - t < 10, str(err.value)


def test_bounded_sandbox_renders_real_templates_as_jinja_does():
    """The bounds change nothing for templates that stay within them: the same text as a plain
    sandboxed render (loops, ~, filters, macros, namespace, tojson)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = ("{% set ns = namespace(n=0) %}{% macro head(r) %}<|{{ r|upper }}|>{% endmacro %}"
              "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ head(m['role']) ~ m['content']|trim }}"
              "{{ '%03d' % ns.n }}{% if loop.last %}{{ messages|map(attribute='role')|join(',') }}{% endif %}"
              "{% endfor %}{{ {'k': eos_token}|tojson }}{{ '-' * 3 }}")
    messages = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    want = plain.render(messages=messages, add_generation_prompt=False, bos_token="<s>", eos_token="</s>")
    assert ChatTemplate(source, "<s>", "</s>").render(messages) == want
