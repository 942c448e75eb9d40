"""Benchmark: how fast the serving simulator replays a long trace, on one core.

Replays 20,000 synthetic RAG requests (prompt ~3k tokens, 16-token blocks) through
``kvlab.serving.simulate`` for BF16 and INT4 pools in the same run, and reports wall
seconds, requests per second, and the INT4 / BF16 time ratio measured side by side.
Results, with the machine they came from, go to ``data/results/serving_replay.json``.

    taskset -c 0 python benchmarks/serving_replay.py [--requests N]
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

from kvlab import serving as S
from kvlab.cli import MAX_REQUESTS, Parser, int_flag, path_flag
from kvlab.env import cpu_model
from kvlab.paths import out_problem

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int_flag(1, MAX_REQUESTS), default=20_000)
    p.add_argument("--out", type=path_flag, default=ROOT / "data" / "results" / "serving_replay.json")
    args = p.parse_args(argv)
    if args.out is not None and (why := out_problem(args.out)):  # before the run, not after it
        p.error(why)
    if args.requests < 1:
        p.error("--requests must be >= 1")
    t = time.perf_counter()
    reqs = S.rag(n=args.requests, docs=500, doc_len=1000, per_request=3, output_len=100, rate=20.0, seed=0)
    gen_s = time.perf_counter() - t
    rows = {}
    for fmt in ("bf16", "int4"):
        t = time.perf_counter()
        res = S.simulate(reqs, "llama-3.1-8b", "H100-80GB", fmt)
        secs = time.perf_counter() - t
        rows[fmt] = {"seconds": round(secs, 2), "requests_per_s": round(len(reqs) / secs),
                     "hit_rate": round(res.hit_rate, 4), "num_blocks": res.num_blocks}
        print(fmt, rows[fmt], flush=True)
    doc = {"date": dt.date.today().isoformat(), "requests": len(reqs), "workload_generation_s": round(gen_s, 2),
           "machine": f"{cpu_model()} ({os.cpu_count()} cpus, one used)",
           "python": platform.python_version(), "results": rows,
           "int4_over_bf16_time": round(rows["int4"]["seconds"] / rows["bf16"]["seconds"], 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
