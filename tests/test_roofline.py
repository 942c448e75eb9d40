import pytest

from kvlab import roofline


def test_llama8b_decode_is_bandwidth_bound():
    s = roofline.decode_step("llama-3.1-8b", 1, 32768, "bf16", gpu="H200")
    assert s.cache_bytes_per_layer == 32768 * 2 * 8 * 128 * 2
    assert s.intensity == pytest.approx(4.0)  # 2 x (32 / 8 query heads per KV head) / 2 bytes
    assert s.ridge > 100 * 1 and s.intensity < s.ridge


def test_predicted_speedup_is_the_bytes_ratio():
    assert roofline.predicted_speedup("llama-3.1-8b", 32768, "fp8") == pytest.approx(2.0, rel=1e-6)
    assert roofline.predicted_speedup("llama-3.1-8b", 32768, "int4") == pytest.approx(16 / 4.5)


def test_mla_is_rejected_with_a_reason():
    with pytest.raises(ValueError, match="MLA"):
        roofline.decode_step("deepseek-v3", 1, 1000)


def test_latest_gpu_run_and_its_figure(tmp_path):
    import json

    assert roofline.latest_gpu_run(tmp_path) is None
    rows = [{"batch": b, "context": 32768, "format": f, "speedup_vs_bf16": s}
            for b, f, s in [(1, "fp8_e4m3", 1.8), (16, "fp8_e4m3", 1.9), (1, "int4", 2.9)]]
    doc = {"gpu": "NVIDIA H200", "rows": rows}
    (tmp_path / "decode_attention_H200_2026-01-01.json").write_text(json.dumps(doc))
    (tmp_path / "decode_attention_H200_2026-02-01.json").write_text(json.dumps(doc | {"gpu": "newer"}))
    assert roofline.latest_gpu_run(tmp_path)["gpu"] == "newer"
    fig = roofline.measured_speedup_figure(doc)
    assert [t.name for t in fig.data] == ["batch 1", "batch 16"] and list(fig.data[0].y) == [1.8, 2.9]
    with pytest.raises(ValueError, match="no rows at context 1024"):
        roofline.measured_speedup_figure(doc, context=1024)
