import math

import pytest
import torch

from kvlab import metrics as M
from kvlab.metrics import attention_errors, attention_logits, attention_output, mse, snr_db


def test_mse_and_snr_by_hand():
    x = torch.ones(1, 2, 3, 4)
    y = x + 0.1
    assert mse(x, y).item() == pytest.approx(0.01)
    assert snr_db(x, y).item() == pytest.approx(20.0)  # 10 log10(1 / 0.01)
    assert math.isinf(snr_db(x, x).item())
    assert mse(x, y, per="head").shape == (2,)
    assert mse(x, y, per=("head", "channel")).shape == (2, 4)


def test_attention_matches_sdpa_with_gqa():
    q, k, v = torch.randn(1, 4, 7, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(attention_output(q, k, v).float(), ref, atol=1e-5)
    s = attention_logits(q, k)
    assert torch.isinf(s[0, 0, 0, 1]) and torch.isfinite(s[0, 0, 1, 0])


def test_attention_errors_zero_when_exact_and_grow_with_noise():
    q, k, v = torch.randn(1, 4, 20, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    e0 = attention_errors(q, k, v, k, v)
    assert e0["logit_rmse"].item() == 0 and e0["output_rel_error"].item() == 0
    small = attention_errors(q, k, v, k + 0.01 * torch.randn_like(k), v)
    big = attention_errors(q, k, v, k + 0.1 * torch.randn_like(k), v)
    assert big["logit_rmse"] > small["logit_rmse"] > 0
    # noise of std s on k gives logit noise of about s * |q| / sqrt(d) per logit
    assert small["logit_rmse"].item() == pytest.approx(0.01 * q.norm(dim=-1).pow(2).mean().sqrt().item() / 4, rel=0.3)
    assert attention_errors(q, k, v, k, v, per="head")["logit_rmse"].shape == (4,)


def test_bad_inputs():
    with pytest.raises(ValueError, match="shapes differ"):
        mse(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 3))
    with pytest.raises(ValueError, match="per must name axes"):
        mse(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), per="row")
    with pytest.raises(ValueError, match="not a multiple"):
        attention_logits(torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 2, 4))


def test_fp8_unit_scale_by_hand():
    exact = torch.tensor([1.0, -2.0, 0.5, 448.0]).view(1, 1, 1, 4)  # all representable in E4M3: no error
    tiny = torch.tensor([2.0**-8, 1.0, 1.0, 1.0]).view(1, 1, 1, 4)  # one value of four below 2^-6
    out = M.fp8_unit_scale([exact, tiny])
    assert out["amax"] == 448.0 and out["subnormal_fraction"] == 1 / 8
    assert out["snr_db"] > 100, "exactly representable values lose nothing"
    clipped = M.fp8_unit_scale([torch.tensor([1000.0, 1.0]).view(1, 1, 1, 2)])
    assert clipped["amax"] == 1000.0 and clipped["snr_db"] < 10, "values past ±448 clip"
    for bad in ([], [torch.tensor([1, 2])], ["x"]):
        with pytest.raises(ValueError, match="floating-point tensors"):
            M.fp8_unit_scale(bad)


def test_engines_offering_matches_engine_options():
    from kvlab.formats import engine_options, engines_offering

    got = engines_offering(["fp8_e4m3", "q4_0"])
    assert "vLLM" in got["fp8_e4m3"] and got["q4_0"] == [e for e, f in engine_options("q4_0").items() if f]


def test_logit_agreement_against_hand_arithmetic():
    from kvlab.metrics import logit_agreement

    t = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    assert logit_agreement(t, t) == (0.0, 1.0)
    # position 0: teacher (1/2, 1/2), student (e/(1+e), 1/(1+e)); position 1: equal
    s = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    p = math.e / (1 + math.e)
    kl0 = 0.5 * math.log(0.5 / p) + 0.5 * math.log(0.5 / (1 - p))
    kl, top1 = logit_agreement(t, s)
    assert kl == pytest.approx(kl0 / 2, rel=1e-6)
    assert top1 == 1.0  # argmax of a tie is its first index, as the student's
    with pytest.raises(ValueError, match="tokens, vocab"):
        logit_agreement(t, s[:1])


def test_first_divergence():
    from kvlab.metrics import first_divergence

    a = torch.tensor([5, 6, 7, 8])
    assert first_divergence(a, a) == 4
    assert first_divergence(a, torch.tensor([5, 6, 0, 8])) == 2
    with pytest.raises(ValueError, match="one length"):
        first_divergence(a, a[:3])


def test_mean_by_format_averages_each_metric_over_layers():
    from kvlab.metrics import mean_by_format

    rows = [{"format": "int8", "layer": 0, "k_snr_db": 40.0, "v_snr_db": 30.0},
            {"format": "int8", "layer": 1, "k_snr_db": 44.0, "v_snr_db": 34.0},
            {"format": "int4", "layer": 0, "k_snr_db": 20.0, "v_snr_db": 10.0}]
    assert mean_by_format(rows) == {"int8": {"k_snr_db": 42.0, "v_snr_db": 32.0},
                                    "int4": {"k_snr_db": 20.0, "v_snr_db": 10.0}}
