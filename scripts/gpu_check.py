"""Everything a lent GPU should run, in one command (`make gpu`), in well under 8 minutes.

1. The kernel tests, natively (`tests/test_decode_attention.py`, `tests/test_quantize_append.py`, the
   cache's fused-kernel tests): on a GPU they compile and run for real instead of under the interpreter.
2. Fused vs unfused peak memory for one decode step (INT4, batch 4, 8 KV heads, head_dim 128, 32k tokens).
3. `benchmarks/decode_attention.py --check` (the kernel vs BF16 SDPA for every format, batch 1 and 8 at 4k, 16k,
   32k and 128k tokens, with achieved GB/s), time-boxed: no point starts after BENCH_BUDGET_S seconds.
4. The quantize-on-append kernel: 4,096 new tokens of 8 sequences written into each format's store, timed.

Writes `data/results/gpu_<gpu>_<date>.json` with the GPU, driver, versions, date and what each step
measured (the benchmark writes its own JSON beside it, which chapter 3 reads). Refuses with exit status 2
on a machine without CUDA.

    python scripts/gpu_check.py [--out DIR]
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the kernel tests the check runs natively; nbmake (a lab plugin) is not on a bare GPU image, so it is switched off
TESTS = ("tests/test_decode_attention.py", "tests/test_quantize_append.py", "tests/test_storage.py", "tests/test_cache.py")
PYTEST_ARGS = ("-q", "-p", "no:cacheprovider", "-p", "no:nbmake")
# the time box (seconds): tests, then the benchmark (no point starts after its budget; the last one may take a minute),
# then the append timing (8 formats: a kernel compile and a few milliseconds each, about a minute)
TESTS_LIMIT_S, BENCH_BUDGET_S, BENCH_LIMIT_S, APPEND_ALLOWANCE_S = 150, 180, 240, 60  # 450 s: under 8 minutes


def _run(cmd, limit: float) -> tuple[int, str]:
    """Exit status and stdout of ``cmd``; a run past ``limit`` seconds is recorded (status 124), not fatal."""
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        return r.returncode, r.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n(stopped after {limit} s)"


def _benchmark_module():
    """benchmarks/decode_attention.py as a module (its append timing), loaded from the repository."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_attention_bench", ROOT / "benchmarks" / "decode_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    from kvlab.cli import Parser, path_flag
    from kvlab.paths import folder_problem

    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=path_flag, default=ROOT / "data" / "results", help="a folder for the results")
    args = p.parse_args(argv)
    if why := folder_problem(args.out):  # a missing folder, /proc, one it may not write: said now
        p.error(why)
    import torch

    if not torch.cuda.is_available():
        p.error("make gpu needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)")
    import triton

    from kvlab.formats import get_format
    from kvlab.fusion import peak_memory, tiled_decode, unfused_decode
    from kvlab.storage import KVStore

    name = torch.cuda.get_device_name(0)
    doc = {"gpu": name, "capability": list(torch.cuda.get_device_capability(0)), "torch": torch.__version__,
           "triton": triton.__version__, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        doc["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        doc["driver"] = "unknown"
    t = time.time()
    code, out = _run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *TESTS], TESTS_LIMIT_S)
    doc["tests"] = {"exit_status": code, "summary": out.strip().splitlines()[-1:], "seconds": round(time.time() - t, 1)}
    f = get_format("int4")
    k = KVStore.from_tensor(torch.randn(4, 8, 32768, 128, device="cuda", dtype=torch.bfloat16), f.key)
    v = KVStore.from_tensor(torch.randn(4, 8, 32768, 128, device="cuda", dtype=torch.bfloat16), f.value)
    q = torch.randn(4, 32, 128, device="cuda")
    _, unfused = peak_memory(unfused_decode, q, k, v)
    _, tiled = peak_memory(tiled_decode, q, k, v)
    doc["peak_memory"] = {"format": "int4", "shape": [4, 8, 32768, 128], "cache_bytes": k.nbytes + v.nbytes,
                          "unfused_peak_bytes": int(unfused), "tiled_peak_bytes": int(tiled)}
    t = time.time()
    bcode, bout = _run([sys.executable, "benchmarks/decode_attention.py", "--check", "--budget-s", str(BENCH_BUDGET_S),
                        "--out", str(args.out)], BENCH_LIMIT_S)
    doc["benchmark"] = {"exit_status": bcode, "tail": bout.strip().splitlines()[-1:], "seconds": round(time.time() - t, 1)}
    try:  # the quantize-on-append kernel, timed per format (a failure is recorded, not fatal)
        from triton.testing import do_bench

        bench = _benchmark_module()
        doc["append"] = bench.time_append(bench.FORMATS, "cuda", do_bench)
    except Exception as e:  # noqa: BLE001 - one line in the record is what a lent GPU's last minute can keep
        doc["append"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    path = args.out / f"gpu_{name.replace(' ', '_')}_{doc['date'][:10]}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", path)
    return 0 if code == 0 and bcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
