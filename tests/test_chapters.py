"""Chapter 4's main-path values on small synthetic model facts (oracle values written out), and on the shipped data."""

import pytest

from kvlab import facts, prose
from kvlab.chapters import where_int4_breaks as ch4
from kvlab.results import Paired


def _model(held, worse_at, prose_at, pooled_lost):
    lengths = [1024, 4096, 8192]
    return {"held": held, "lengths": lengths, "by": {f: {"worse_at": w} for f, w in worse_at.items()},
            "prose": {"by": {f: {"worse_at": w} for f, w in prose_at.items()}},
            "pooled": {f: Paired(f, "fp32", 75, 70 - n, 70, n, 0) for f, n in pooled_lost.items()}}


def test_needle_cell_says_where_a_format_was_worse():
    m = _model(["a"], {"a": [], "b": [4096], "c": [], "d": [1024, 4096, 8192]},
               {"b": [4096, 8192], "d": [1024, 4096, 8192]}, {"a": 0, "b": 3, "c": 7, "d": 40})
    assert ch4.needle_cell(m, "a") == "✓"
    assert ch4.needle_cell(m, "b") == "✗ 4k; prose 4k, 8k"
    assert ch4.needle_cell(m, "c") == "✗ pooled"  # 7 lost, none gained: p = 0.016
    assert ch4.needle_cell(m, "d") == "✗ every length"


def test_flip_rate_is_the_largest_chance_gain_of_an_8bit_format():
    def model(gains):
        return {"pooled": {f: Paired(f, "fp32", 200, 150, 150 - g + 1, 1, g) for f, g in zip(ch4.EIGHT_BIT, gains)}}
    assert ch4.flip_rate({"S": model([0, 1, 2]), "G": model([3, 0, 0])}) == 3 / 200


def test_the_main_path_sections_hold_and_render_on_the_shipped_data():
    F = facts.where_int4_breaks()
    for section, fn in ch4.SECTIONS.items():
        values = fn(F)
        assert values.failed() == {}, section
        assert prose.render("04_where_int4_breaks", section, values).strip()
    card = ch4.card(F).splitlines()
    assert len(card) == 2 + len(ch4.CARD) and all(f"`{f}`" in "\n".join(card) for f in ch4.CARD)


@pytest.mark.slow  # computes four chapters' facts (chapter 5's replays): the book build shows the page too
def test_the_start_page_states_what_the_chapters_found():
    from kvlab.chapters import start_here

    X = start_here.found()
    assert X.failed() == {}
    text = prose.render("00_start_here", "found", X)
    assert len(text.split()) <= 300 and "What we found" in text
    assert ("decode speed on a GPU" in text) == (not start_here.gpu_runs()), "the unmeasured list follows the data"


def test_gpu_runs_are_the_gpu_check_files(tmp_path):
    from kvlab.chapters import start_here

    (tmp_path / "gpu_H100_2026-12-01.json").write_text("{}")
    (tmp_path / "decode_cpu.json").write_text("{}")
    assert [p.name for p in start_here.gpu_runs(tmp_path)] == ["gpu_H100_2026-12-01.json"]


def test_values_a_scale_reads_the_key_layout():
    # per token: a head's whole key; groups: their size; KIVI-4: 32 tokens of one channel; per tensor: everything
    assert [ch4.values_a_scale(f, 256) for f in ("int4_token", "int4", "q4_0", "int4_g16", "kivi-4")] == [256, 64, 32, 16, 32]
    assert ch4.values_a_scale("int4_tensor", 256) == float("inf")


# ------------------------------------------------------------------ chapter 6


def test_short_flag_drops_the_notes_after_an_option():
    from kvlab.chapters.choosing_a_format import short_flag

    assert short_flag("--kv-cache-dtype fp8 (= fp8_e4m3)") == "--kv-cache-dtype fp8"
    assert short_flag("-ctk q4_0 -ctv q4_0 -fa on, llama.cpp's default since PR #21038") == "-ctk q4_0 -ctv q4_0 -fa on"
    assert short_flag("TurbomindEngineConfig(quant_policy=8) / lmdeploy serve api_server --quant-policy 8") == \
        "lmdeploy serve api_server --quant-policy 8"
    assert short_flag("NVFP4 KV Cache: quantize the checkpoint offline") == "NVFP4 KV Cache"


def test_the_engine_card_lists_every_quantized_option_of_every_serving_engine():
    from kvlab.chapters.choosing_a_format import card_rows
    from kvlab.formats import engine_table

    t, rows = engine_table(), card_rows()
    listed = {(e, f) for e, _, f, _ in rows}
    for key, engine in t["engines"].items():
        if key == "transformers":
            continue
        for fmt, opts in t["presets"].items():
            if opts.get(key) and fmt not in ("bf16", "fp16", "fp32"):
                # llama.cpp's q4_0 and q8_0 rotate by default: the card shows the rotated format instead
                assert (engine["name"], fmt) in listed or (engine["name"], fmt + "+rotate") in listed, (key, fmt)
    assert ("llama.cpp", "q4_0+rotate") in listed and ("llama.cpp", "q4_0") not in listed
    assert ("vLLM", "int4_token+rotate") in listed  # vLLM's int4_per_token_head is only near a kvlab format
    assert not any(e == "transformers" for e, *_ in rows)


def test_chapter_6s_hand_count_and_card_on_the_shipped_data():
    """(test_facts renders every section of the chapter from its function and checks the claims.)"""
    from kvlab.chapters import choosing_a_format as ch6

    F = facts.choosing_a_format("llama-3.1-8b", "H100-80GB", "bf16", 32768, 64, list(ch6_formats()))
    H = ch6.by_hand(F)
    # oracle: 32 layers x 2 (K, V) x 8 heads x 128 values x 2 bytes x 24,576 tokens (3/4 of 32k) = 3 GiB a sequence
    assert H["context"] == 24576 and H["per_seq_gib"] == 3.0 and H["fits"] == int(H["free_gib"] // 3)
    card = ch6.card(F)["engine_card_md"].splitlines()
    assert len(card) == 2 + len(ch6.card_rows())


def ch6_formats():
    return ("bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int8_tensor", "lmdeploy-int8", "q8_0", "kivi-4", "int4", "q4_0",
            "int4_tensor")


# ------------------------------------------------------------------ chapter 5


def test_chapter_5s_hand_counts_are_the_arithmetic():
    """Oracle: a 16-token FP8 block of Llama-3.1-8B is 16 x 32 layers x 2 x 8 heads x 128 x 1 byte = 1 MiB, so
    10 GiB holds 10,240; INT4's 4.5 bits against FP8's 8 make 3 GiB of FP8 blocks 1.6875 GiB in INT4."""
    from kvlab.chapters import prefix_cache as ch5

    H = ch5.by_hand({"model": "llama-3.1-8b"})  # the check reads only the chapter's model
    assert H["block_mib"] == 1 and H["blocks"] == 10_240
    assert H["int4_gib"] == pytest.approx(3 * 4.5 / 8)


# ------------------------------------------------------------------ chapter 3


def _synthetic_run(tmp_path):
    """A small made-up benchmark file (marked synthetic; never shipped): two batches, two contexts, two formats."""
    import json

    rows = [{"batch": b, "context": t, "format": f, "us": 10.0, "baseline_bf16_sdpa_us": 10.0 * s,
             "speedup_vs_bf16": s, "bytes_read": 1, "bandwidth_gbs": 1000.0 * s, "fraction_of_peak": 0.2 * s}
            for b in (1, 8) for t in (4096, 32768) for f, s in (("bf16", 1.0), ("int8", 1.8))]
    doc = {"date": "2026-12-07T00:00:00+00:00", "gpu": "SYNTHETIC GPU", "driver": "0", "torch": "x", "triton": "y",
           "peak_bandwidth_bytes_per_s": 4.8e12, "rows": rows, "synthetic": True,
           "not_measured": [{"batch": 8, "context": 131072, "why": "time box of 200 s reached"}]}
    (tmp_path / "decode_attention_SYNTHETIC_2026-12-07.json").write_text(json.dumps(doc))
    return tmp_path


def test_chapter_3_renders_a_recorded_gpu_run_and_says_so_without_one(tmp_path):
    from kvlab import roofline
    from kvlab.chapters import triton_attention as ch3

    run = roofline.latest_gpu_run(_synthetic_run(tmp_path))
    fig = roofline.measured_bandwidth_figure(run)
    assert len(fig.data) == 2 * 2 * 2  # 2 formats x (GB/s, speed-up) x 2 batches
    text = " ".join(prose.render("03_triton_attention", "live-gpu-measured", ch3.gpu_measured(run)).split(" "))
    text = text.replace("\n", " ")
    assert "SYNTHETIC GPU" in text and "synthetic file" in text and "1 point was not measured" in text
    assert "| `int8` | 1.80x | 1.97x |" in text  # measured beside the bytes ratio (16 / 8.125 bits) at batch 1, 32k
    assert "36%" in text  # the best fraction of peak: 0.2 x 1.8
    assert "No GPU measurement" in prose.render("03_triton_attention", "gpu-none", ch3.gpu_measured(None))
