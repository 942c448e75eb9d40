import subprocess
import sys

import pytest
import torch

from kvlab.paths import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the refusal on a machine without CUDA")
@pytest.mark.slow  # seconds of waiting: in make test, not make quick
def test_make_gpu_refuses_clearly_without_cuda():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("gpu_check.py: error: make gpu needs a CUDA GPU") and len(r.stderr.splitlines()) == 1


# what a bare CUDA image lacks (issue 44): the lab's packages; the check must not need them
BARE_IMAGE_LACKS = ("plotly", "ipywidgets", "anywidget", "gguf", "jupyterlab", "nbclient", "nbformat", "nbconvert",
                    "playwright", "IPython", "nbmake")


def _gpu_check():
    """scripts/gpu_check.py as a module (its selection of tests), without running it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the refusal on a machine without CUDA")
@pytest.mark.slow
def test_the_gpu_check_runs_where_the_lab_packages_are_missing(tmp_path):
    """In a Python that cannot import the lab's packages (as on the bare GPU image), the check's imports and its test
    selection still load, and it refuses cleanly for lack of CUDA."""
    import os

    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        f"BLOCKED = {set(BARE_IMAGE_LACKS)!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(name + ' is not on the bare GPU image')\n"
        "sys.meta_path.insert(0, Block())\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    blocked = subprocess.run([sys.executable, "-c", "import plotly"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "not on the bare GPU image" in blocked.stderr  # the block works
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr[-2000:]
    check = _gpu_check()
    r = subprocess.run([sys.executable, "-m", "pytest", *check.PYTEST_ARGS, "--collect-only", *check.TESTS], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "tests collected" in r.stdout, r.stdout[-2000:]
    r = subprocess.run([sys.executable, "benchmarks/decode_attention.py", "--help"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def _benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_attention_bench", ROOT / "benchmarks" / "decode_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_check_measures_batch_1_and_8_from_4k_to_128k_within_its_time_box():
    bench, check = _benchmark(), _gpu_check()
    assert bench.POINTS["check"] == [(1, 4096), (1, 16384), (1, 32768), (1, 131072),
                                     (8, 4096), (8, 16384), (8, 32768), (8, 131072)]
    assert check.TESTS_LIMIT_S + check.BENCH_LIMIT_S + check.APPEND_ALLOWANCE_S < 8 * 60
    assert check.BENCH_BUDGET_S < check.BENCH_LIMIT_S
    clock = iter(range(0, 1000, 60)).__next__  # each call: another minute gone
    saved = []
    rows, missed = bench.measure(bench.POINTS["check"], lambda b, t: "too big" if t == 16384 else [{"b": b, "t": t}],
                                 budget_s=200, clock=clock, on_row=lambda r, m: saved.append((len(r), len(m))))
    assert rows == [{"b": 1, "t": 4096}, {"b": 1, "t": 32768}]  # started at 0 min; 1, 2 and 3 min in: the box is 200 s
    assert [m["why"] for m in missed] == ["too big"] + ["time box of 200 s reached"] * 5
    assert saved[-1] == (2, 6)  # the file is rewritten after every point and at the end, every skipped point named


def test_the_append_timing_runs_its_path_for_every_format_on_a_cpu():
    """On a GPU the check times quantize-on-append with do_bench; here a timer that calls once runs the same path."""
    bench = _benchmark()
    calls = []

    def timer(fn):
        fn()
        calls.append(1)
        return 2.0  # ms

    rows = bench.time_append(["bf16", "int8", "int4"], "cpu", timer, batch=1, tokens=64)
    assert [r["format"] for r in rows] == ["bf16", "int8", "int4"] and len(calls) == 3
    # oracle: 64 tokens x 8 heads x 128 values: BF16 2 bytes each; INT4 half a byte plus a 2-byte scale and zero per 64
    assert rows[0]["bytes_written"] == 64 * 8 * 128 * 2 and rows[2]["bytes_written"] == 64 * 8 * (64 + 2 * 4)
    assert rows[0]["us"] == 2000.0 and rows[0]["write_gbs"] == round(64 * 8 * 128 * 2 / 2000 / 1e3, 1)
