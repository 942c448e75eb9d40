"""Benchmark: how long the two test loops take on this machine (the brief's limits: `make quick` under a minute,
`make test` under 15 minutes of tests on 2 cores).

Reads pytest's own summary line ("N passed ... in 64.69s") from the output of a run: run the target here
(``--run quick``), or read the saved output of one (``--log FILE --target test``, e.g. the output of
``make test 2>&1 | tee test.log``). Results, with the machine and date, are merged into
``data/results/test_times.json`` (one entry per target, the latest run).

    python benchmarks/test_times.py --run quick
    python benchmarks/test_times.py --log test.log --target test
"""

from __future__ import annotations

import datetime as dt
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from kvlab.cli import Parser, path_flag
from kvlab.env import machine
from kvlab.paths import RESULTS_DIR, out_problem, read_json, write_json

ROOT = Path(__file__).resolve().parents[1]
LIMITS_S = {"quick": 60, "test": 15 * 60}  # seconds of tests (pytest's own clock), per the brief
_SUMMARY = re.compile(r"^=* ?(?P<counts>[0-9]+ (?:passed|failed|error)[^=\n]*?) in (?P<secs>[0-9.]+)s(?: \([0-9:]+\))?(?: =+)?$",
                      re.M)


def pytest_seconds(text: str) -> list[dict]:
    """Every pytest summary line in ``text``: ``[{"counts": "650 passed, 1 skipped", "seconds": 64.69}, ...]``
    (``make test`` runs pytest once; a log may hold several runs)."""
    return [{"counts": m["counts"].strip(), "seconds": float(m["secs"])} for m in _SUMMARY.finditer(text)]


def main(argv=None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=["quick"], help="run this make target here and time it")
    p.add_argument("--log", type=path_flag, help="read a saved run's output instead")
    p.add_argument("--target", choices=sorted(LIMITS_S), help="which make target the --log comes from")
    p.add_argument("--out", type=path_flag, default=RESULTS_DIR / "test_times.json")
    args = p.parse_args(argv)
    if bool(args.run) == bool(args.log):
        p.error("give either --run quick or --log FILE --target NAME")
    if args.log and not args.target:
        p.error("--log needs --target (quick or test)")
    if args.log and not args.log.is_file():
        p.error(f"--log {args.log} is not a readable file")
    if why := out_problem(args.out):
        p.error(why)
    doc = {"what": "seconds of tests (pytest's own clock) per make target, latest run each", "targets": {}}
    if args.out.is_file():  # read (and checked) before a run, not after it
        try:
            doc = read_json(args.out, "--out", {"targets": dict})
        except ValueError as e:
            p.error(str(e))
        doc.setdefault("targets", {})
    target = args.run or args.target
    wall = None
    if args.run:
        t0 = time.perf_counter()
        r = subprocess.run(["make", target], cwd=ROOT, capture_output=True, text=True)
        wall, text = time.perf_counter() - t0, r.stdout + r.stderr
        if r.returncode:
            print(text[-3000:], file=sys.stderr)
            p.error(f"make {target} failed (exit {r.returncode}); nothing recorded")
    else:
        text = args.log.read_text(errors="replace")
    runs = pytest_seconds(text)
    if not runs:
        p.error("no pytest summary line found ('N passed in Xs')")
    seconds = sum(r["seconds"] for r in runs)
    doc["targets"][target] = {
        "test_seconds": round(seconds, 1), "limit_seconds": LIMITS_S[target], "within_limit": seconds < LIMITS_S[target],
        "runs": runs, "wall_seconds": None if wall is None else round(wall, 1),
        "machine": machine(), "python": platform.python_version(),
        "date": dt.date.today().isoformat(), "source": "this script ran it" if args.run else str(args.log.name),
    }
    write_json(args.out, doc)
    print(f"make {target}: {seconds:.1f} s of tests (limit {LIMITS_S[target]} s) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
