"""Benchmark: what one shared full-precision prefill saves when a sweep covers many KV formats.

On SmolLM2-135M-Instruct, the same passkey prompts are swept, in one run and side by side:

* 1 format (fp32) — one prefill per prompt batch, one decode;
* 10 formats — the same prefills, shared: each format's cache is filled from them and decoded;
* 10 formats, no sharing — each format quantizes its own prefill (``prefill="cached"``), the cost
  a sweep would pay without the shared prefill.

Reports wall seconds and the ratios to the 1-format run, with the machine, to
``data/results/shared_prefill.json``. The target: 10 formats cost at most 2x one.

    python benchmarks/shared_prefill.py [--length 2048] [--prompts 5]
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path

from kvlab.cli import MAX_LENGTH, Parser, int_flag, path_flag
from kvlab.env import cpu_model
from kvlab.paths import out_problem, write_json

ROOT = Path(__file__).resolve().parents[1]

TEN = ["fp32", "bf16", "fp8_e4m3", "int8", "q8_0", "int4", "int4_token", "q4_0", "kivi-4", "kivi-2"]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int_flag(64, MAX_LENGTH), default=2048)
    p.add_argument("--prompts", type=int_flag(1, 10_000), default=5)
    p.add_argument("--no-separate", action="store_true", help="skip the slow one-prefill-per-format run")
    p.add_argument("--out", type=path_flag, default=ROOT / "data" / "results" / "shared_prefill.json")
    args = p.parse_args(argv)
    if args.out is not None and (why := out_problem(args.out)):  # before the run, not after it
        p.error(why)
    import torch

    from kvlab import evals
    from kvlab.models import load_model

    model, tok = load_model()
    window = model.config.max_position_embeddings
    if args.length > window:
        p.error(f"--length: {args.length} tokens is past smollm2-135m's {window}-token window")
    kw = dict(lengths=[args.length], depths=[0.5], trials=args.prompts, batch_size=args.prompts, progress=False)
    one = timed(lambda: evals.passkey_sweeps(model, tok, ["fp32"], **kw))
    shared = timed(lambda: evals.passkey_sweeps(model, tok, TEN, **kw))
    separate = None if args.no_separate else timed(lambda: evals.passkey_sweeps(model, tok, TEN, prefill="cached", **kw))
    out = {
        "benchmark": "shared_prefill", "model": "smollm2-135m", "length": args.length, "prompts": args.prompts,
        "formats": TEN, "seconds": {"1 format": round(one, 1), "10 formats, shared prefill": round(shared, 1),
                                    "10 formats, one prefill each": None if separate is None else round(separate, 1)},
        "ratio_shared_to_one": round(shared / one, 2),
        "ratio_separate_to_one": None if separate is None else round(separate / one, 2),
        "target": "10 formats with a shared prefill cost at most 2x one format",
        "meets_target": shared / one <= 2.0,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "torch": torch.__version__, "date": dt.date.today().isoformat(),
    }
    write_json(args.out, out)  # atomic, through a symbolic link to its target (checked before the run)
    print(json.dumps(out["seconds"]), f"shared/one = {out['ratio_shared_to_one']}x, separate/one = "
          f"{out['ratio_separate_to_one']}x")


if __name__ == "__main__":
    main()
