"""Regenerate chapter 4's data: every KV format on every rung of the eval ladder, on the shipped model.

Writes ``data/results/eval_sweep.json``: for each format, held-out perplexity,
passkey exact match over context length x depth, 2-hop chain exact match over
length, and a side-by-side comparison with the full-precision teacher — plus
how long it took and on what machine.

    python scripts/sweep_evals.py                 # the full sweep (CPU: see the timing in the JSON)
    python scripts/sweep_evals.py --quick         # a small slice, for a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlab import evals  # noqa: E402
from kvlab.formats import get_format  # noqa: E402
from kvlab.models import MODEL_DIR, load_model  # noqa: E402


def formats():
    """Plain formats, then INT4 variants with each mitigation, one at a time and together."""
    int4 = get_format("int4_token")
    kivi2 = get_format("kivi-2")
    return [
        get_format("fp32"), get_format("bf16"), get_format("fp8_e4m3"), get_format("fp8_e5m2"),
        get_format("int8"), get_format("int4_tensor"), int4, get_format("int4"), get_format("q4_0"),
        get_format("kivi-4"), kivi2,
        int4.with_options(sinks=4), int4.with_options(residual=128), int4.with_options(rotate=True),
        int4.with_options(sinks=4, residual=128, rotate=True),
        kivi2.with_options(rotate=True), get_format("int4_tensor").with_options(rotate=True),
    ]




def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "data" / "results" / "eval_sweep.json")
    p.add_argument("--trials", type=int, default=None)
    args = p.parse_args(argv)
    model, tok = load_model()
    train = json.loads((MODEL_DIR / "training.json").read_text())
    max_len = max(st["seq_len"] for run in (train, train.get("previous", train)) for st in run["stages"])
    if args.quick:
        lengths, depths, trials, fmts = [512, 2048], [0.0, 1.0], args.trials or 2, formats()[:3]
    else:
        lengths = [512, 1024, 2048, 4096, 8192]
        depths, trials, fmts = [0.0, 0.25, 0.5, 0.75, 1.0], args.trials or 4, formats()
    t0 = time.time()
    out = {"model": "kvlab-tiny", "lengths": lengths, "depths": depths, "trials": trials,
           "machine": f"{platform.machine()} {platform.processor()} {torch.get_num_threads()} threads",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "trained_max_length": max_len,
           "formats": {}}
    for fmt in fmts:
        t = time.time()
        pk = evals.passkey_sweep(model, tok, fmt, lengths, depths, trials, progress=False)
        ch = evals.chain_sweep(model, tok, fmt, [n for n in lengths if n <= 4096], [1.0], hops=2,
                               trials=trials * 2, progress=False)
        row = {
            "source": fmt.source,
            "bits_per_element": fmt.bits_per_element(64),
            "perplexity": evals.perplexity(model, tok, fmt, max_windows=4 if args.quick else 16),
            "passkey": pk.rows,
            "chain2": ch.rows,
            "teacher": evals.teacher_comparison(model, tok, fmt, evals.GOLDEN_PROMPTS[:2] if args.quick else evals.GOLDEN_PROMPTS,
                                                max_new_tokens=24),
            "seconds": round(time.time() - t, 1),
        }
        out["formats"][fmt.name] = row
        print(f"{fmt.name:<28} ppl {row['perplexity']:8.3f}  passkey {pk.accuracy():5.1%}  "
              f"chain {ch.accuracy():5.1%}  kl {row['teacher']['kl']:.4f}  ({row['seconds']}s)", flush=True)
        out["seconds"] = round(time.time() - t0, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")  # after every format: resumable reading
    print(f"wrote {args.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
