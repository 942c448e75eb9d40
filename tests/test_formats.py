"""Format names: one parser resolves every format the shipped results name."""

import json

import pytest

from kvlab import budget as B
from kvlab.formats import FORMATS, KVFormat, get_format
from kvlab.paths import DATA_DIR


def shipped_format_names() -> set[str]:
    """Every KV format a shipped result file names, read from the files themselves."""
    names = set()
    res = DATA_DIR / "results"
    for path in res.glob("long_sweep*.jsonl"):
        names |= set(json.loads(path.read_text().splitlines()[0])["formats"])
    names |= set(json.loads((res / "eval_sweep.json").read_text())["formats"])
    for path in res.glob("engines_*.json"):
        for key, row in json.loads(path.read_text()).get("formats", {}).items():
            names.add(row.get("kvlab_format", key))  # an engine's own label maps to the preset it is checked against
    return names


def test_every_shipped_format_resolves():
    names = shipped_format_names()
    assert {"int4_g16", "hf-int2", "kivi-2+rotate", "int4_token+sinks4", "int4_token@global"} <= names
    for n in names:
        assert get_format(n).name == n


def test_a_layer_type_mix_names_its_layers():
    mix = get_format("int4_token@global")
    assert mix.for_layer(None) == get_format("int4_token")  # a global layer
    assert mix.for_layer(512).name == "fp32"  # a sliding-window layer
    assert get_format("int4_token@sliding").layer_names == {"sliding_attention": "int4_token"}
    # a mix built in code (no "@" in its name) stores its own quantizers on the layers it does not override
    from dataclasses import replace

    custom = replace(get_format("int8"), name="mine", layers=(("full_attention", get_format("q4_0")),))
    assert custom.for_layer(None) == get_format("q4_0")
    assert custom.for_layer(512).key == get_format("int8").key and not custom.for_layer(512).layers


@pytest.mark.parametrize("bad, match", [("int4@everywhere", "@global or @sliding"), ("int9", "unknown KV format"),
                                        ("int4+twist", "unknown option"), ("int4_token@global@sliding", "layer type"),
                                        ("int4+sinks99999999999", "at most 999,999 tokens")])
def test_bad_names_say_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        get_format(bad)


def test_a_mix_cannot_nest():
    with pytest.raises(ValueError, match="plain KVFormat"):
        KVFormat("x", get_format("fp32").key, get_format("fp32").value, layers=(("full_attention", get_format("int4_token@global")),))


def test_a_mix_budget_is_its_layers_budgets():
    """Gemma 3 270M: 3 global layers in INT4, 15 sliding layers in fp32; each layer costs what its format costs."""
    mix = B.budget("gemma-3-270m", 2, 4096, "int4_token@global")
    full = B.budget("gemma-3-270m", 2, 4096, "fp32")
    int4 = B.budget("gemma-3-270m", 2, 4096, "int4_token")
    windows = [layer.window for layer in B.load_shape("gemma-3-270m").layers]
    want = [f if w else i for w, f, i in zip(windows, full.per_layer_bytes, int4.per_layer_bytes)]
    assert list(mix.per_layer_bytes) == want
    assert int4.cache_bytes < mix.cache_bytes < full.cache_bytes


@pytest.mark.parametrize("bad, match", [("x@sliding", "'x'"), ("int4\t@global", "no spaces"), ("int4+sinks4+sinks8", "twice"),
                                        ("int4+rotate+rotate", "twice"), ("int4+sinks\u0663", "unknown option"),
                                        ("a" * 100_000, "at most 200")])
def test_names_that_are_not_formats_are_refused_briefly(bad, match):
    with pytest.raises(ValueError, match=match) as e:
        get_format(bad)
    assert len(str(e.value)) < 600


@pytest.mark.parametrize("kw, match", [(dict(layers="ab"), "pairs"), (dict(layers=[]), "pairs"), (dict(residual=True), "residual"),
                                       (dict(sinks=10**30), "sinks"), (dict(name=None), "name")])
def test_a_kvformat_checks_its_fields(kw, match):
    f = get_format("fp32")
    with pytest.raises(ValueError, match=match):
        KVFormat(**({"name": "x", "key": f.key, "value": f.value} | kw))


def test_a_mix_refuses_a_model_without_that_layer_type():
    with pytest.raises(ValueError, match="has none"):
        B.budget("llama-3.1-8b", 1, 10, "int4@sliding")


def test_nvfp4_steps_change_one_thing_at_a_time_and_end_at_nvfp4():
    from dataclasses import asdict

    from kvlab.formats import nvfp4_steps

    steps = nvfp4_steps()
    assert [s.bits_per_element(64) for s in steps] == [4.5, 5.0, 4.5, 4.5]
    assert steps[0].key == get_format("q4_0").key and steps[-1].key == steps[-1].value == get_format("nvfp4").key
    assert all(s.name not in FORMATS for s in steps)  # compared, not offered
    for a, b in zip(steps, steps[1:]):
        changed = {k for k, v in asdict(a.key).items() if asdict(b.key)[k] != v} - {"full_range"}  # E2M1 has no -8
        assert len(changed) == 1 and a.key == a.value and b.key == b.value, (a.name, b.name, changed)


def test_engine_conditions_name_what_the_engine_options_require():
    """Each condition belongs to a preset some engine stores, and says what that engine's own option says."""
    from kvlab.formats import engine_conditions, engine_options, engine_table, engines_offering

    conditions = engine_table()["conditions"]
    assert set(conditions) >= {"int8", "nvfp4", "q4_0", "int8_tensor"}
    for name, text in conditions.items():
        assert engines_offering([name])[name], f"{name}: a condition on a format no engine stores"
        assert engine_conditions(name) == text
    assert "TRITON_ATTN" in engine_conditions("int8") and "TRITON_ATTN" in engine_options("int8")["vLLM"]
    assert "Blackwell" in engine_conditions("nvfp4") and all(
        "Blackwell" in v or "SM100" in v for v in engine_options("nvfp4").values() if v)
    assert "LLAMA_ATTN_ROT_DISABLE=1" in engine_conditions("q4_0") and "LLAMA_ATTN_ROT_DISABLE=1" in engine_options("q4_0")["llama.cpp"]
    assert "ModelOpt" in engine_conditions("int8_tensor") and "ModelOpt" in engine_options("int8_tensor")["TensorRT-LLM"]
    assert engine_conditions("kivi-4") is None and engine_conditions("bf16") is None
    with pytest.raises(ValueError, match="not a preset"):
        engine_conditions("q4_0+rotate")
