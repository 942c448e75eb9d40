"""Benchmark: how long `kvlab` commands take from the shell, start-up included.

Each command runs as a fresh process ``--repeats`` times, the commands in turn (so the machine's
noise is spread over all of them); the median wall time is reported, beside ``python -c pass`` measured
the same way as the floor. Results, with the machine, go to ``data/results/cli_startup.json``.

    python benchmarks/cli_startup.py [--repeats 7]
"""

from __future__ import annotations

import datetime as dt
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvlab.cli import Parser, int_flag, path_flag
from kvlab.env import machine
from kvlab.paths import RESULTS_DIR, out_problem, write_json

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "python -c pass (floor)": ["-c", "pass"],
    "kvlab budget (preset, --gpu)": ["-m", "kvlab", "budget", "--model", "llama-3.1-70b", "--batch", "8",
                                     "--context", "32768", "--kv-dtype", "fp8", "--gpu", "H100-80GB", "--json"],
    "kvlab budget (folder config: kvlab-tiny)": ["-m", "kvlab", "budget", "--model", "kvlab-tiny", "--batch", "1",
                                                "--context", "1000", "--json"],
    "kvlab formats --engines": ["-m", "kvlab", "formats", "--engines"],
    "kvlab serve-sim (rag workload)": ["-m", "kvlab", "serve-sim", "--workload", "rag", "--model", "llama-3.1-8b",
                                       "--gpu", "L4", "--json"],
    "kvlab serve-sim (missing trace)": ["-m", "kvlab", "serve-sim", "--trace", "/nonexistent.jsonl"],
    "kvlab budget (bad --batch)": ["-m", "kvlab", "budget", "--model", "llama-3.1-8b", "--batch", "-1",
                                   "--context", "8"],
    "kvlab niah (bad --endpoint URL)": ["-m", "kvlab", "niah", "--endpoint", "ftp://host", "--lengths", "64"],
    "kvlab serve (bad --host)": ["-m", "kvlab", "serve", "--kv-format", "int8", "--host", "999.1.1.1"],
}


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int_flag(1, 1000), default=7)
    p.add_argument("--out", type=path_flag, default=RESULTS_DIR / "cli_startup.json")
    args = p.parse_args(argv)
    if args.out is not None and (why := out_problem(args.out)):  # before the run, not after it
        p.error(why)
    if args.repeats < 1:
        p.error("--repeats must be a positive integer")
    times = {k: [] for k in COMMANDS}
    for _ in range(args.repeats):
        for name, cmd in COMMANDS.items():
            t = time.perf_counter()
            subprocess.run([sys.executable, *cmd], capture_output=True, cwd=ROOT)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    doc = {"date": dt.date.today().isoformat(), "machine": machine(),
           "python": platform.python_version(), "repeats": args.repeats,
           "median_seconds": {k: round(v, 3) for k, v in med.items()},
           "max_seconds": {k: round(max(v), 3) for k, v in times.items()}}
    for k, v in med.items():
        print(f"{v * 1000:8.0f} ms  {k}")
    write_json(args.out, doc)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
