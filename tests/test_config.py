"""Recipes, overrides and layout strings: good ones load, bad ones give one-line errors."""
from __future__ import annotations

import pytest

from megamoe.core.config import ParallelConfig, validate_model_parallel
from megamoe.core.errors import ConfigError
from megamoe.core.layout import LayerKind, parse_layout
from megamoe.recipe import load_recipe, shipped_recipes


def test_layout_repetition_and_cuts():
    lay = parse_layout("Ad (GeGeGeAe)*2 | Sd Mn")
    assert lay.num_layers == 11
    assert lay.layers[0] == LayerKind("A", "d") and lay.layers[4] == LayerKind("A", "e")
    assert lay.cuts == (9,)
    assert lay.stages(2) == [list(range(9)), [9, 10]]
    assert lay.compact() == "AdGeGeGeAeGeGeGeAe|SdMn"
    assert parse_layout("(Ad)*4").stages(2) == [[0, 1], [2, 3]]


def test_nested_groups():
    assert parse_layout("((Ad)*2 Se)*3").num_layers == 9


def test_shipped_recipes_load():
    names = shipped_recipes()
    assert "tiny_dense" in names
    for name in names:
        r = load_recipe(name)
        validate_model_parallel(r.model, r.parallel)


def test_overrides_apply():
    r = load_recipe("tiny_dense", ["model.hidden_size=256", "model.attention.num_heads=8",
                                   "parallel.tp=2", "model.layout=(Ad)*3"])
    assert r.model.hidden_size == 256 and r.model.attention.num_heads == 8 and r.parallel.tp == 2
    assert r.model.parsed_layout().num_layers == 3


BAD = [
    # (overrides, text the one-line error must contain)
    (["model.foo=1"], "foo"),
    (["model.hidden_size=abc"], "model.hidden_size"),
    (["model.attention.num_heads=6"], "model.attention.num_heads"),  # 128 % 6 != 0
    (["model.attention.num_kv_heads=3"], "model.attention.num_kv_heads"),
    (["model.attention.partial_rotary_factor=1.5"], "partial_rotary_factor"),
    (["model.params_dtype=float8"], "model.params_dtype"),
    (["model.vocab_size=0"], "model.vocab_size"),
    (["model.layout=AdXd"], "at position 2: unknown mixer letter 'X'"),
    (["model.layout=AdA"], "must be followed by an MLP letter"),
    (["model.layout=Adz"], "unexpected 'z'"),
    (["model.layout=(Ad)"], "at position 4: a group must be followed by '*N'"),
    (["model.layout=(Ad"], "missing ')'"),
    (["model.layout=Ad)"], "at position 2: unmatched ')'"),
    (["model.layout=(Ad)*0"], "repeat count must be >= 1"),
    (["model.layout=Ad||Ad"], "stage ('|') is empty"),
    (["model.layout=GdAd"], "model.gdn is not set"),
    (["parallel.tp=0"], "parallel.tp"),
    (["model.hidden_size"], "not of the form key=value"),
]


@pytest.mark.parametrize("overrides,needle", BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_one_line_error(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny_dense", overrides)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert needle in msg, msg


@pytest.mark.parametrize("parallel,needle", [
    (ParallelConfig(tp=8), "model.attention.num_heads=4 is invalid: must be divisible by parallel.tp=8"),
    (ParallelConfig(pp=3), "do not split evenly into parallel.pp*vpp=3"),
])
def test_bad_model_parallel_combination(parallel, needle):
    r = load_recipe("tiny_dense")
    with pytest.raises(ConfigError, match=None) as e:
        validate_model_parallel(r.model, parallel)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_world_size_mismatch():
    with pytest.raises(ConfigError) as e:
        ParallelConfig(tp=2, pp=2).validate(world_size=6)
    assert "parallel.tp*pp*cp=4" in str(e.value) and "world size 6" in str(e.value)


def test_stage_count_mismatch():
    with pytest.raises(ConfigError, match="2 pipeline stages"):
        parse_layout("Ad|Ad").stages(4)


def test_missing_and_broken_recipe_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
