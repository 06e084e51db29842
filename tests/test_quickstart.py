"""The quickstart's path, shortened: train the VLM recipe on generated shapes through the
trainer, export to HF qwen3_5_moe, transformers agrees with megamoe on the exported weights,
and the model captions an image."""
from __future__ import annotations

from pathlib import Path


def quickstart_case(out: str) -> dict:
    from megamoe.convert import export_hf
    from megamoe.training.entry import load_train_recipe, run_training

    recipe = load_train_recipe("quickstart_vlm", ["train.steps=16", f"checkpoint.dir={out}", "logging.progress=false",
                                                  "data.generator_samples=256", "checkpoint.save_interval=0"])
    summary = run_training(recipe)
    export_hf(out, Path(out) / "hf", family="qwen3_5_moe", progress=False)
    return {"first": summary["first_loss"], "last": summary["last"]["loss"], "log_dir": summary["log_dir"]}


def test_quickstart_trains_exports_and_captions(pool, tmp_path):
    import numpy as np
    import torch

    from megamoe.convert import from_hf
    from megamoe.convert.verify import verify
    from megamoe.data import load_tokenizer
    from megamoe.data.shapes import draw_sample
    from megamoe.generate import generate

    out = tmp_path / "quickstart"
    res = pool(1).run(quickstart_case, str(out))[0]
    assert res["last"] < res["first"] - 1.0, res  # it learns the captions' language quickly
    assert (Path(res["log_dir"]) / "metrics.jsonl").is_file()
    report = verify(out / "hf", new_tokens=8)
    assert report.ok, str(report)
    model = from_hf(out / "hf")
    image, _ = draw_sample(np.random.default_rng([2026, 12]))
    pixels = model.vision.preprocessor()(image)
    n = model.vision.image_tokens(image)
    ids = torch.tensor([[model.image_token_id] * n])
    caption = generate(model, ids, 12, images=[pixels], eos_token_id=load_tokenizer("byte").eos_id)[0, n:]
    assert model.image_token_id not in caption.tolist() and len(caption) > 0
