"""Perplexity of llama.cpp's block caches with and without a Hadamard rotation, on the paired sweep's passages.

llama.cpp (since PR #21038) rotates Q, K and V with a Hadamard transform whenever its cache is quantized; kvlab's
``q4_0`` and ``q8_0`` presets store the same blocks without it, and ``q4_0+rotate`` / ``q8_0+rotate`` add kvlab's
rotation. This scores every format on the same held-out passages the long sweep reads (``evals.perplexity_windows``,
512 tokens, every token reading the cache) and writes each passage's summed NLL per format, with the machine, so
``kvlab.results.rotation_ppl`` can compare them paired::

    python scripts/rotation_ppl.py                      # SmolLM2, 16 passages (140 s here on 2 cores)
    python scripts/rotation_ppl.py --model gemma3-270m --out data/results/rotation_ppl_gemma3.json   # (271 s)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMATS = ["fp32", "q4_0", "q4_0+rotate", "q8_0", "q8_0+rotate"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=16, help="held-out passages of 512 tokens")
    p.add_argument("--formats", nargs="+", default=FORMATS, help="kvlab formats; the first is the reference")
    p.add_argument("--out", type=Path, default=ROOT / "data" / "results" / "rotation_ppl.json")
    args = p.parse_args(argv)
    if not 1 <= args.windows <= 64:
        p.error("--windows must be between 1 and 64")
    from kvlab.formats import get_format
    from kvlab.paths import out_problem, write_json

    for f in args.formats:
        try:
            get_format(f)
        except ValueError as e:
            p.error(f"--formats: {e}")
    if (problem := out_problem(args.out)) is not None:
        p.error(problem)

    import torch
    import transformers

    from kvlab import evals
    from kvlab.env import machine
    from kvlab.models import load_model

    model, tok = load_model(args.model)
    wins = evals.perplexity_windows(tok, window=512, max_windows=args.windows)
    t0 = time.time()
    nll = {f: [] for f in args.formats}
    for i, x in enumerate(wins):
        for f in args.formats:
            nll[f].append(round(evals.window_nll(model, x, f), 4))
        print(f"passage {i + 1}/{len(wins)}: {time.time() - t0:.0f}s", flush=True)
    write_json(args.out, {
        "what": "summed NLL per held-out passage (512 tokens, every token reading the cache) for llama.cpp's block "
                "formats with and without a Hadamard rotation; the first format is the reference",
        "model": args.model, "formats": args.formats, "tokens": [int(x.shape[1]) - 1 for x in wins], "nll": nll,
        "seconds": round(time.time() - t0, 1), "date": time.strftime("%Y-%m-%d"),
        "machine": machine(torch.get_num_threads()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__}})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
