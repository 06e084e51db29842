"""The decode API through the whole model: a hybrid of every attention mixer, a prompt given
at once then one token at a time, equals the full forward's logits."""
from __future__ import annotations

import torch

from megamoe.layers.cache.decode import InferenceCache
from tests.mixer_utils import tiny_model
from tests.numerics import rel_err


def test_hybrid_model_decoding_equals_full_forward():
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize

    model = LanguageModel(tiny_model("LdMdDdIdSdAd"))
    initialize(model, model.groups, seed=0)
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = InferenceCache(2)
        steps = [model(ids[:, :4], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(4, 10)]
    assert cache.seen == 10
    assert rel_err(torch.cat(steps, dim=1), full) <= 1e-5
