"""Benchmark: fused decode attention over each KV format vs torch SDPA over a BF16 cache.

On CUDA, one attention layer shaped like Llama-3.1-8B's (32 query heads, 8 KV heads, head_dim 128) is timed
with ``triton.testing.do_bench`` at each (batch, context) point, every format side by side with the baseline
in the same run. The points: ``--check`` (what ``scripts/gpu_check.py`` runs) batch 1 and 8 at 4k, 16k, 32k
and 128k tokens; ``--quick`` four small points; by default batch 1, 16, 64 at 1k, 8k, 32k, 128k. Points
that do not fit are skipped, and no point starts after ``--budget-s`` seconds (a lent GPU's time is short);
both are recorded. Reported per point: microseconds; effective bandwidth = bytes of codes + scales + zeros
(+ q and output) read / time, and its fraction of the GPU's peak HBM bandwidth (``data/presets/gpus.json``);
speedup over the BF16 SDPA baseline. Results go to ``data/results/decode_attention_<gpu>_<date>.json`` with
the date, GPU, driver, torch and triton versions, rewritten after every point so a stopped run keeps what it
measured.

On a CPU there is nothing meaningful to time (the kernel runs in Triton's interpreter): the script runs a
short correctness check and says so.

    python benchmarks/decode_attention.py [--check | --quick] [--budget-s S] [--out DIR]
"""

from __future__ import annotations

import datetime as dt
import platform
import subprocess
import time
from pathlib import Path

from kvlab.cli import Parser, path_flag

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ["bf16", "fp8_e4m3", "fp8_e5m2", "int8", "lmdeploy-int8", "int4", "q4_0", "lmdeploy-int4"]
HQ, HKV, D = 32, 8, 128
POINTS = {  # (batch, context) in the order they are measured: the cheap ones first, so a time box keeps them
    "quick": [(1, 1024), (16, 1024), (1, 8192), (16, 8192)],
    "check": [(b, t) for b in (1, 8) for t in (4096, 16384, 32768, 131072)],
    "full": [(b, t) for b in (1, 16, 64) for t in (1024, 8192, 32768, 131072)],
}


def measure(points, time_point, budget_s: float, clock=time.monotonic, on_row=None) -> tuple[list[dict], list[dict]]:
    """Run ``time_point(batch, context)`` (a list of rows, or a string saying why the point was skipped) for
    each point until ``budget_s`` seconds have passed; returns ``(rows, not_measured)``, each point that was
    not run named with the reason. ``on_row`` is called with the rows so far after each point."""
    start, rows, missed = clock(), [], []
    for b, t in points:
        if clock() - start > budget_s:
            missed.append({"batch": b, "context": t, "why": f"time box of {budget_s:g} s reached"})
            continue
        got = time_point(b, t)
        if isinstance(got, str):
            missed.append({"batch": b, "context": t, "why": got})
        else:
            rows += got
        if on_row is not None:
            on_row(rows, missed)
    if on_row is not None:
        on_row(rows, missed)  # once more at the end: the points the time box skipped are named in the file too
    return rows, missed


def make_cache(fmt, B, T, device, chunk=4096):
    """K and V stores of ``B`` random sequences of ``T`` tokens, filled ``chunk`` tokens at a time
    (on CUDA through the append kernel), into buffers of exactly ``T`` tokens."""
    import torch

    from kvlab.formats import get_format
    from kvlab.storage import KVStore

    f = get_format(fmt)
    k, v = (KVStore.allocate(q, B, HKV, T, D, device) for q in (f.key, f.value))
    for t0 in range(0, T, chunk):
        n = min(chunk, T - t0)
        k.append(torch.randn(B, HKV, n, D, device=device, dtype=torch.bfloat16))
        v.append(torch.randn(B, HKV, n, D, device=device, dtype=torch.bfloat16))
    return k, v


def gpu_info():
    import torch

    name = torch.cuda.get_device_name(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    from kvlab.budget import gpus

    peak = None
    for key, g in gpus().items():
        if key.split("-")[0].lower() in name.lower():
            peak = g.bandwidth_bytes_per_s
    return name, driver, peak


def run_cuda(mode: str, out_dir: Path, budget_s: float):
    import torch
    import triton
    from triton.testing import do_bench

    from kvlab.kernels.decode_attention import decode_attention
    from kvlab.paths import write_json

    name, driver, peak = gpu_info()
    doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": name, "driver": driver,
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D}, "peak_bandwidth_bytes_per_s": peak,
           "mode": mode, "budget_s": budget_s,
           "baseline": "torch.nn.functional.scaled_dot_product_attention over a BF16 cache (enable_gqa)",
           "timer": "triton.testing.do_bench (median of repeated runs)", "rows": [], "not_measured": []}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"decode_attention_{name.replace(' ', '_')}_{doc['date'][:10]}.json"

    def time_point(B, T):
        bf16_bytes = 2 * B * HKV * T * D * 2
        if 3 * bf16_bytes > torch.cuda.mem_get_info()[0]:  # baseline cache + a quantized copy + headroom
            return f"{bf16_bytes / 1e9:.1f} GB of BF16 cache does not fit beside the rest"
        q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
        kb = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16)
        vb = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16)
        base_us = 1e3 * do_bench(lambda q=q, kb=kb, vb=vb: torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], kb, vb, enable_gqa=True))
        del kb, vb
        lens = torch.full((B,), T, dtype=torch.int32, device="cuda")
        rows = []
        for fmt in FORMATS:
            k, v = make_cache(fmt, B, T, "cuda")
            us = 1e3 * do_bench(lambda q=q, k=k, v=v, lens=lens: decode_attention(q, k, v, lens))
            read = k.nbytes + v.nbytes + 2 * q.numel() * 4
            rows.append({"batch": B, "context": T, "format": fmt, "us": round(us, 2),
                         "baseline_bf16_sdpa_us": round(base_us, 2), "speedup_vs_bf16": round(base_us / us, 3),
                         "bytes_read": read, "bandwidth_gbs": round(read / us / 1e3, 1),
                         "fraction_of_peak": None if peak is None else round(read / (us * 1e-6) / peak, 3)})
            print(rows[-1], flush=True)
            del k, v
            torch.cuda.empty_cache()
        return rows

    def save(rows, missed):  # after every point: a run stopped from outside keeps what it measured
        write_json(path, doc | {"rows": rows, "not_measured": missed})

    rows, missed = measure(POINTS[mode], time_point, budget_s, on_row=save)
    print("wrote", path, f"({len(rows)} rows; not measured: {len(missed)} points)")
    return doc | {"rows": rows, "not_measured": missed}


def time_append(formats, device: str, timer, batch: int = 8, tokens: int = 4096) -> list[dict]:
    """The quantize-on-append path (on CUDA the append kernel): ``tokens`` new tokens of ``batch`` sequences written
    into each format's K store, timed by ``timer(fn) -> ms`` (``triton.testing.do_bench`` on a GPU). Reported: the
    microseconds and the GB/s of codes and scales written."""
    import torch

    from kvlab.formats import get_format
    from kvlab.storage import KVStore

    x = torch.randn(batch, HKV, tokens, D, device=device, dtype=torch.bfloat16)
    rows = []
    for fmt in formats:
        store = KVStore.allocate(get_format(fmt).key, batch, HKV, tokens, D, device)

        def append(store=store):
            store.tokens = 0  # write over the same buffers each time: the append itself is what is timed
            store.append(x)
        us = 1e3 * timer(append)
        written = store.nbytes
        rows.append({"format": fmt, "batch": batch, "tokens": tokens, "us": round(us, 2), "bytes_written": written,
                     "write_gbs": round(written / us / 1e3, 1)})
    return rows


def run_cpu():
    import torch

    from kvlab.kernels.decode_attention import decode_attention, decode_attention_reference

    print("No CUDA device: timing Triton's interpreter would measure numpy, not the kernel.")
    print("Running a short correctness check of every format instead (no numbers are recorded).")
    lens = torch.tensor([64, 7], dtype=torch.int32)
    for fmt in FORMATS:
        k, v = make_cache(fmt, 2, 64, "cpu")
        q = torch.randn(2, HQ, D)
        err = (decode_attention(q, k, v, lens) - decode_attention_reference(q, k, v, lens)).abs().max().item()
        print(f"  {fmt:<14} max |kernel - reference| = {err:.2e}")
        assert err < 1e-4, f"{fmt}: kernel disagrees with the reference"
    print("correct on CPU; run on a CUDA machine for timings")


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="four small points only")
    which.add_argument("--check", action="store_true", help="batch 1 and 8 at 4k, 16k, 32k, 128k (scripts/gpu_check.py)")
    p.add_argument("--budget-s", type=float, default=3600.0,
                   help="start no point after this many seconds (default 3600)")
    p.add_argument("--out", type=path_flag, default=ROOT / "data" / "results", help="a folder for the results")
    args = p.parse_args(argv)
    if not 0 < args.budget_s <= 86400:  # NaN fails this too
        p.error(f"--budget-s must be a number of seconds in (0, 86400], got {args.budget_s}")
    from kvlab.paths import folder_problem

    if why := folder_problem(args.out):  # before torch loads and before a long run, not when the result is written
        p.error(why)
    import torch

    if torch.cuda.is_available():
        run_cuda("quick" if args.quick else "check" if args.check else "full", args.out, args.budget_s)
    else:
        run_cpu()


if __name__ == "__main__":
        main()
