"""Run the real engines kvlab's presets mirror beside kvlab, and write what they measured.

``--quanto``: ``transformers``' ``QuantizedCache`` with the quanto backend (``optimum-quanto``) vs the
``hf-int4`` / ``hf-int2`` presets on SmolLM2-135M-Instruct, same passkey prompts, one shared prefill
(:func:`kvlab.engines.quanto_side_by_side`). Writes ``data/results/engines_quanto.json`` with the
versions, machine and run time; chapter 4 reads it.

    python scripts/compare_engines.py --quanto [--lengths 512 1024 2048] [--trials 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvlab import engines  # noqa: E402
from kvlab.env import cpu_model  # noqa: E402
from kvlab.models import load_model  # noqa: E402
from kvlab.paths import RESULTS_DIR  # noqa: E402


def write(path: Path, doc: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quanto", action="store_true", required=True, help="transformers' QuantizedCache (quanto)")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "engines_quanto.json")
    args = p.parse_args(argv)
    if args.trials < 1 or args.new_tokens < 2 or min(args.lengths) < 64:
        p.error("--trials must be >= 1, --new-tokens >= 2 and every length >= 64")
    if args.out.is_dir() or not args.out.parent.is_dir():
        p.error(f"--out {args.out}: must be a file in an existing folder")
    torch.manual_seed(0)
    model, tok = load_model()
    t = time.time()
    res = engines.quanto_side_by_side(model, tok, lengths=tuple(args.lengths), trials=args.trials,
                                      new_tokens=args.new_tokens, progress=True)
    doc = {"what": "transformers QuantizedCache(backend='quanto') vs kvlab's matching preset, SmolLM2-135M-Instruct, "
                   "passkey prompts (filler haystack, needle at depth 0.5), one shared full-precision prefill",
           "lengths": args.lengths, "trials": args.trials, "new_tokens": args.new_tokens,
           "formats": {k: {**v, "engine": {str(n): c for n, c in v["engine"].items()},
                           "kvlab": {str(n): c for n, c in v["kvlab"].items()}} for k, v in res.items()},
           "versions": {p_: md.version(p_) for p_ in ("transformers", "optimum-quanto", "torch")},
           "machine": cpu_model(), "threads": torch.get_num_threads(), "seconds": round(time.time() - t),
           "date": dt.date.today().isoformat()}
    write(args.out, doc)
    print(json.dumps({k: {"identical": f"{v['identical']}/{v['prompts']}", "mean_kl": round(v["mean_kl"], 4)}
                      for k, v in res.items()}))
    return doc


if __name__ == "__main__":
    main()
