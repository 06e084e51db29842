"""The quickstart, shortened, as a user runs it (bash pretrain_scripts/quickstart.sh): train the
VLM recipe on generated shapes, export to HF qwen3_5_moe, caption held-out images with
transformers; its accuracy line is printed, parsed and recorded. And the caption scoring rules."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ACCURACY = re.compile(r"held-out caption accuracy: (\d+)/(\d+) exact = ([\d.]+)% "
                      r"\(colour ([\d.]+)%, shape ([\d.]+)%, place ([\d.]+)%")


def run_quickstart(out: Path, images: int, *overrides: str) -> str:
    env = {**os.environ, "OUT": str(out), "EVAL_IMAGES": str(images), "PYTHONWARNINGS": "ignore",
           "MEGAMOE_VENV": sys.prefix,  # the script's env.sh reuses this interpreter's environment
           "OMP_NUM_THREADS": "1"}  # tiny matmuls; 2 spinning threads crawl on a machine the suite oversubscribes
    # its own process group: on a timeout the script's python children are ended with it
    proc = subprocess.Popen(["bash", "pretrain_scripts/quickstart.sh", *overrides], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=850)  # a loaded machine; tests/run.sh allows 900
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("the shortened quickstart took over 850 s") from None
    assert proc.returncode == 0, f"quickstart exited {proc.returncode}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return stdout


def test_quickstart_trains_exports_and_reports_held_out_accuracy(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megamoe.diagnostics.verify import verify

    out = tmp_path / "quickstart"
    stdout = run_quickstart(out, 6, "train.steps=16", "data.generator_samples=256", "logging.progress=false",
                            "checkpoint.save_interval=0")
    match = ACCURACY.search(stdout)
    assert match, stdout[-3000:]
    right, total, exact = int(match[1]), int(match[2]), float(match[3])
    assert total == 6 and 0 <= right <= total and exact == pytest.approx(100 * right / total, abs=0.05)
    assert all(0 <= float(match[i]) <= 100 for i in (4, 5, 6))
    assert stdout.count("[quickstart]     took") == 4 and "[quickstart] done in" in stdout
    records = [json.loads(line) for line in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 16 and records[-1]["caption_exact"] == pytest.approx(right / total)
    assert records[-1]["caption_images"] == 6 and records[-1]["caption_seed"] == 2026
    assert records[-2]["loss"] < records[0]["loss"] - 1.0  # it learns the captions' language quickly
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("eval/caption_exact")] == [(16, round(right / total, 6))]
    report = verify(tmp_path / "quickstart_hf", new_tokens=8)  # transformers and megamoe agree on the exported weights
    assert report.ok, str(report)


def test_caption_scores_count_exact_matches_and_fields_per_shape():
    from megamoe.diagnostics.caption_eval import score_captions
    from megamoe.data.shapes import parse_caption

    assert parse_caption("a red circle at the top and a blue square on the right") == [
        ("red", "circle", "at the top"), ("blue", "square", "on the right")]
    assert parse_caption("a ble on the ble") == [(None, None, None)]
    truths = ["a red circle at the top", "a blue square on the left and a green triangle on the right",
              "a yellow triangle in the middle", "a black circle on the left and a red square on the right"]
    generated = ["a red circle at the top",
                 "a blue circle on the left and a green triangle on the left",  # shape 1, place 2 wrong
                 "a yellow triangle in the middle and a red square on the right",  # an extra shape: not exact
                 "a black circle on the left"]  # the second shape is missing: wrong in all three fields
    score = score_captions(generated, truths, seed=7)
    assert (score.correct, score.exact) == (1, 0.25)
    assert score.fields == pytest.approx({"colour": 5 / 6, "shape": 4 / 6, "place": 4 / 6})
    assert score.metrics()["caption_exact"] == 0.25 and score.metrics()["caption_seed"] == 7
    line, right, wrong = score.report().splitlines()
    assert line.startswith("held-out caption accuracy: 1/4 exact = 25.0% (colour 83.3%, shape 66.7%, place 66.7%")
    assert "image 0" in right and "image 1" in wrong


def test_held_out_pairs_refuse_the_training_seed():
    from megamoe.diagnostics.caption_eval import held_out_pairs
    from megamoe.core.errors import ConfigError
    from megamoe.recipe import load_train_recipe

    recipe = load_train_recipe("quickstart_vlm", ["data.seed=5"])
    with pytest.raises(ConfigError, match="held-out seed 5 is data.seed"):
        held_out_pairs(recipe, 4, seed=5)
    import numpy as np

    from megamoe.data.shapes import shape_pairs

    held_out, train = held_out_pairs(recipe, 4, seed=6), shape_pairs(4, seed=5)
    assert len(held_out) == 4 and all(caption.startswith("a ") for _, caption in held_out)
    assert all(not np.array_equal(np.asarray(a), np.asarray(b)) for (a, _), (b, _) in zip(held_out, train))


def test_confirm_greedy_gives_transformers_greedy_decoding_from_any_draft():
    """A draft that equals transformers' greedy decoding is accepted as is; a draft with a wrong
    token is corrected there and finished by transformers: both rows end up exactly as a full
    forward per new token decodes them."""
    import torch

    from megamoe.diagnostics.caption_eval import confirm_greedy, greedy
    from megamoe.vision.hf_qwen import images_to_pixel_values
    from tests.test_convert_qwen import tiny_qwen3_5_moe

    hf = tiny_qwen3_5_moe().eval()
    token, vocab, eos, new = hf.config.image_token_id, hf.config.text_config.vocab_size, -1, 6  # eos -1: never
    gen = torch.Generator().manual_seed(3)
    pixels = [images_to_pixel_values(torch.randn(1, 3, 16, 16, generator=gen), patch_size=4, merge_size=2)
              for _ in range(2)]  # 16x16 -> 2x2 tokens each
    ids = torch.full((2, 4), token)
    with torch.no_grad():
        want = greedy(hf, ids, torch.cat([p for p, _ in pixels]), torch.cat([g for _, g in pixels]), token, eos, new)
        draft = want.clone()
        draft[1, 4 + 2] = (draft[1, 4 + 2] + 1) % vocab if (draft[1, 4 + 2] + 1) % vocab != token else 0
        rows, fixed = confirm_greedy(hf, draft, pixels, token, eos, 4, new)
    assert fixed == 1 and rows == want[:, 4:].tolist()
    assert len(set(map(tuple, rows))) == 2  # the two images decode differently (the test can tell rows apart)
