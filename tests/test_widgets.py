import pytest

from kvlab import budget as B
from kvlab.widgets import BudgetExplorer, memory_breakdown

CACHE = 2  # weights, engine reserve, KV cache, free


def test_slider_updates_figure_in_place():
    e = BudgetExplorer(model="llama-3.1-8b", gpu="H100-80GB", kv_format="bf16", batch=4, context=4096)
    bar_trace, curve_trace = e.bar.data[CACHE], e.curve.data[0]
    assert bar_trace.name == "KV cache"
    before = e.bar.data[CACHE].x[0]
    e.batch.value = 8  # programmatic slider move
    assert e.bar.data[CACHE] is bar_trace  # same trace object: updated, not re-rendered
    assert e.bar.data[CACHE].x[0] == 2 * before
    e.context.value = 8192
    assert e.bar.data[CACHE].x[0] == 4 * before
    assert tuple(e.curve.data[-1].x) == (8192,) and tuple(e.curve.data[-1].y) == (8,)
    old_curve = tuple(curve_trace.y)
    e.gpu.value = "L4"
    assert e.curve.data[0] is curve_trace and tuple(curve_trace.y) != old_curve


def test_kv_format_dropdown_halves_cache():
    e = BudgetExplorer(model="llama-3.1-8b", kv_format="bf16")
    c16 = e.bar.data[CACHE].x[0]
    e.kv_format.value = "fp8_e4m3"
    assert e.bar.data[CACHE].x[0] == pytest.approx(c16 / 2, rel=1e-6)  # + one fp32 scale per layer


def test_curves_leave_out_what_fits_nowhere_and_mark_the_window():
    e = BudgetExplorer(model="llama-3.1-70b", gpu="H200", weights_dtype="fp8")
    ys = dict(zip([t.name for t in e.curve.data], [t.y for t in e.curve.data]))
    assert ys["bf16"][-1] is None and ys["bf16"][0] > 0  # 1M tokens of BF16 cache fit nowhere: no point, not 0.5
    assert e.curve.layout.shapes[0].x0 == B.load_shape("llama-3.1-70b").max_position_embeddings
    assert len({t.line.dash for t in e.curve.data[:-1]}) == len(e.curve.data) - 1  # FP8 and INT8 drawn apart


def test_bad_tp_shows_error_instead_of_raising():
    e = BudgetExplorer(model="qwen2.5-7b")
    e.tp.value = 4  # 28 query heads, 4 KV heads: one KV head per rank
    assert "fits" in e.status.value
    e.tp.value = 8  # vLLM refuses: 28 attention heads do not split over 8 ranks
    assert "must divide the model's 28 attention heads" in e.status.value
    e.model.value = "llama-3.1-8b"
    assert "GiB" in e.status.value


def test_memory_breakdown_adds_up():
    m = memory_breakdown("llama-3.1-8b", "H100-80GB", "fp8", "bf16", 4, 8192)
    assert abs(m["weights"] + m["reserve"] + m["cache"] + m["free"] - m["capacity"]) < 1e-6
    assert m["reserve"] == pytest.approx(B.DEFAULT_RESERVE_GIB)
    assert m["cache"] * 1024**3 == B.budget("llama-3.1-8b", 4, 8192, "fp8").cache_bytes


def test_prefix_cache_explorer_updates_in_place():
    from kvlab.widgets import PrefixCacheExplorer

    e = PrefixCacheExplorer(model="llama-3.1-8b", gpu="L4", workload="few-shot", n_requests=40, pool_gib=(2, 4))
    trace = e.fig.data[0]
    before = tuple(trace.y)
    e.workload.value = "rag"
    assert e.fig.data[0] is trace and tuple(trace.y) != before
    assert "blocks" in e.table.value
    assert f"${B.gpus()['L4'].usd_per_hour:.2f}/GPU-hour" in e.table.value, "the explorer prices at the GPU's listed rate"
    e.model.value = "llama-3.1-70b"  # weights do not fit on an L4: an error line, not an exception
    assert "no memory" in e.table.value


def test_cost_quality_table_flags_perplexity_with_its_own_slider():
    from kvlab import serving as S
    from kvlab.widgets import CostQualityTable

    q = {"bf16": {512: 1.0}, "int4": {512: 1.0}}
    t = CostQualityTable(S.few_shot(n=20), "llama-3.1-8b", "L4", ["bf16", "int4"], q, perplexity={"bf16": 0, "int4": 0.12})
    assert len(t.controls) == 2 and "color:#b00" in t.table.value  # +12% over the 5% default
    t.max_ppl.value = 0.2
    assert "color:#b00" not in t.table.value and all(r["ppl_ok"] for r in t.rows)
    assert len(CostQualityTable(S.few_shot(n=20), "llama-3.1-8b", "L4", ["int4"], q).controls) == 1


def test_quant_error_explorer_updates_in_place():
    import torch

    from kvlab.models import Capture
    from kvlab.widgets import QuantErrorExplorer

    k = [torch.randn(1, 2, 16, 64) for _ in range(2)]
    cap = Capture(k, [torch.randn(1, 2, 16, 64) for _ in range(2)], [torch.randn(1, 4, 16, 64)] * 2, None, [0.125] * 2)
    e = QuantErrorExplorer(cap)
    trace = e.fig.data[0]
    s_int4 = e.status.value
    e.element.value = "int8"
    assert e.fig.data[0] is trace and e.status.value != s_int4
    assert e.group.disabled  # per token: the group size means nothing, and the slider says so
    e.gran.value = "group"
    assert not e.group.disabled
    e.group.value = 16
    assert "bits per element" in e.status.value


def _sweep():
    def rows(c512, c2048):
        return [{"length": n, "depth": d, "trials": 5, "correct": c} for n, c in ((512, c512), (2048, c2048))
                for d in (0.0, 1.0)]

    return {"model": "m", "formats": {
        "fp32": {"passkey": rows(5, 5), "passkey_prose": rows(5, 4)},
        "int4_tensor": {"passkey": rows(4, 1), "passkey_prose": []}}}


def test_sweep_explorer_follows_the_dropdown_and_the_haystack():
    from kvlab.widgets import SweepExplorer

    e = SweepExplorer(_sweep(), kv_format="fp32")
    trace = e.fig.data[0]
    assert tuple(map(tuple, trace.z)) == ((1.0, 1.0), (1.0, 1.0))
    e.kv_format.value = "int4_tensor"
    assert e.fig.data[0] is trace and tuple(trace.z[0]) == (0.8, 0.2)
    assert "2048 tokens: <b>20%</b>" in e.status.value and "fp32 100%" in e.status.value
    e.haystack.value = "prose"
    assert "was not swept" in e.status.value
    e.kv_format.value = "fp32"
    assert tuple(trace.z[0]) == (1.0, 0.8) and "prose" in e.fig.layout.title.text
    with pytest.raises(ValueError, match="formats of the sweep"):
        SweepExplorer(_sweep(), kv_format="int3")


def test_budget_explorer_names_the_engine_flag():
    e = BudgetExplorer(model="llama-3.1-8b", kv_format="fp8_e4m3")
    assert "--kv-cache-dtype fp8" in e.status.value
    e.kv_format.value = "int4"
    assert "no serving engine" in e.status.value


def test_cost_quality_table_with_paired_verdicts_has_only_the_perplexity_slider():
    from kvlab import serving as S
    from kvlab.widgets import CostQualityTable

    needle = {"bf16": {"A": "reference"}, "int4": {"A": "held"}}
    t = CostQualityTable(S.few_shot(n=20), "llama-3.1-8b", "L4", ["bf16", "int4"], needle=needle,
                         perplexity={"int4": {"A": 0.12}})
    assert t.controls == [t.max_ppl] and "needle, A" in t.table.value and "color:#b00" in t.table.value
    t.max_ppl.value = 0.2
    assert "color:#b00" not in t.table.value and all(r["ppl_ok"] is not False for r in t.rows)
    with pytest.raises(ValueError, match="no measured quality for \\['q4_0'\\]"):
        CostQualityTable(S.few_shot(n=20), "llama-3.1-8b", "L4", ["q4_0"], needle=needle)
    with pytest.raises(ValueError, match="give the measured quality"):
        CostQualityTable(S.few_shot(n=20), "llama-3.1-8b", "L4", ["int4"])


def test_a_panel_names_the_control_and_the_allowed_values_of_a_bad_argument():
    """ipywidgets would say "Invalid selection: value not found", or clamp a slider's value without a word."""
    from kvlab.widgets import PrefixCacheExplorer

    for kw, what in ((dict(model="nope"), "model 'nope' is not one of: .*llama-3.1-8b"),
                     (dict(tp=3), "tp 3 is not one of: 1, 2, 4, 8"), (dict(formats=()), "formats must name at least one KV format"),
                     (dict(batch=0), "batch must be an integer from 1 to 256"),
                     (dict(context=1e12), "context must be a number from 512"),
                     (dict(kv_format="int4"), "kv_format 'int4' is not one of: bf16, fp8_e4m3, int8")):
        with pytest.raises(ValueError, match="BudgetExplorer: " + what):
            BudgetExplorer(**({"formats": ("bf16", "fp8_e4m3", "int8")} if "kv_format" in kw else {}) | kw)
    with pytest.raises(ValueError, match="unknown KV format|not a known"):
        BudgetExplorer(formats=("bf16", "nope"))
    with pytest.raises(ValueError, match="PrefixCacheExplorer: workload 'nope' is not one of"):
        PrefixCacheExplorer(workload="nope")
    with pytest.raises(ValueError, match="each pool_gib must be a number"):
        PrefixCacheExplorer(pool_gib=(0, 1))


def test_an_all_zero_capture_says_the_snr_is_undefined():
    import torch

    from kvlab.models import Capture
    from kvlab.widgets import QuantErrorExplorer

    z = [torch.zeros(1, 2, 16, 64) for _ in range(2)]
    cap = Capture(z, z, [torch.randn(1, 4, 16, 64)] * 2, None, [0.125] * 2)
    e = QuantErrorExplorer(cap)
    assert "nan" not in e.status.value.lower() and "undefined" in e.status.value
    with pytest.raises(ValueError, match="QuantErrorExplorer: layer must be an integer from 0 to 1, got 99"):
        QuantErrorExplorer(cap, layer=99)
