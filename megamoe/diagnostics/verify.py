"""Check a conversion against ``transformers``: logits on a random prompt and greedy decoding."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megamoe.convert.api import from_hf
from megamoe.checkpoint.hf_io import read_config
from megamoe.inference.generate import generate


@dataclass
class Report:
    max_abs_logits: float
    decode_equal: bool
    hf_tokens: list
    megamoe_tokens: list
    atol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_logits <= self.atol and self.decode_equal

    def __str__(self) -> str:
        return (f"logits max abs diff {self.max_abs_logits:.3e} (tolerance {self.atol:.0e}); greedy decoding "
                f"{'identical' if self.decode_equal else 'DIFFERS'} ({len(self.hf_tokens[0])} tokens)"
                + ("" if self.decode_equal else f"\n  transformers: {self.hf_tokens}\n  megamoe:      {self.megamoe_tokens}"))


def load_hf_model(hf_dir: str | Path):
    """The transformers model of a directory, on CPU in fp32, by its declared architecture."""
    import transformers

    config = read_config(hf_dir)
    arch = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    cls = getattr(transformers, arch, None) or transformers.AutoModelForCausalLM
    return cls.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


@torch.no_grad()
def verify(hf_dir: str | Path, *, prompt_len: int = 12, new_tokens: int = 16, batch: int = 2, seed: int = 0,
           atol: float = 1e-4, hf_model=None, model=None, forward=None, reference: bool = True) -> Report | None:
    """megamoe's logits and greedy tokens against transformers' on a random prompt.

    At a parallel layout every rank passes its ``model`` stage and ``forward`` (a
    ``megamoe.inference.distributed.StageForward``); only the rank with ``reference`` loads the
    transformers model and gets the report (the others get None)."""
    model = model if model is not None else from_hf(hf_dir)
    model.float()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    # a vision-language model's image placeholder needs an image: keep it out of the text prompt,
    # and out of the generated tokens on both sides (megamoe's generate always suppresses it)
    placeholder = getattr(model, "image_token_id", None)
    suppress = None if placeholder is None else [placeholder]
    if placeholder is not None:
        ids[ids == placeholder] = (placeholder + 1) % vocab
    out = (model(ids) if forward is None else forward(ids, last_only=False)).float()
    mm_gen = generate(model, ids, new_tokens, forward=forward)
    if not reference:
        return None
    hf_model = hf_model if hf_model is not None else load_hf_model(hf_dir)
    ref = hf_model(input_ids=ids).logits.float()
    # an explicit mask: otherwise generate() treats prompt tokens equal to pad_token_id as padding
    hf_gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0, min_new_tokens=new_tokens,
                               suppress_tokens=suppress)
    return Report((ref - out).abs().max().item(), torch.equal(hf_gen, mm_gen), hf_gen[:, prompt_len:].tolist(),
                  mm_gen[:, prompt_len:].tolist(), atol)
