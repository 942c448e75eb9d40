"""Run the real engines kvlab's presets mirror beside kvlab, and write what they measured.

``--llama-cpp``: llama.cpp (``llama-cpp-python``, built by ``make peers``) runs SmolLM2's GGUF file itself
with K and V cache types f16, q8_0 and q4_0 (flash attention on), on the passkey prompts of chapter 4's
sweep (:func:`kvlab.engines.llamacpp_passkey`). Writes ``data/results/engines_llamacpp.json``; chapter 4
puts it beside kvlab's emulation of the same cache types. ``--quick`` runs only the first case (f16, one
prompt at 512 tokens) and writes nowhere unless ``--out`` is given.

``--quanto``: ``transformers``' ``QuantizedCache`` with the quanto backend (``optimum-quanto``) vs the
``hf-int4`` / ``hf-int2`` presets on SmolLM2-135M-Instruct, same passkey prompts, one shared prefill
(:func:`kvlab.engines.quanto_side_by_side`). Writes ``data/results/engines_quanto.json`` with the
versions, machine and run time; chapter 4 reads it.

    python scripts/compare_engines.py --quanto [--lengths 512 1024 2048] [--trials 5]
    python scripts/compare_engines.py --llama-cpp [--lengths 512 2048] [--trials 5]   # 8192 adds ~45 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvlab import engines  # noqa: E402
from kvlab.env import cpu_model  # noqa: E402
from kvlab.models import load_model  # noqa: E402
from kvlab.paths import RESULTS_DIR, write_json  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--quanto", action="store_true", help="transformers' QuantizedCache (quanto)")
    which.add_argument("--llama-cpp", action="store_true", help="llama.cpp on the GGUF file (make peers)")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="llama.cpp: the first case only (a smoke test)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not args.lengths:  # llama.cpp at 8192 tokens adds ~45 minutes on 2 cores: pass --lengths to include it
        args.lengths = [512, 1024, 2048] if args.quanto else [512, 2048]
    if args.trials < 1 or args.new_tokens < 2 or min(args.lengths) < 64:
        p.error("--trials must be >= 1, --new-tokens >= 2 and every length >= 64")
    if not all(0 <= d <= 1 for d in args.depths):
        p.error("--depths must be in [0, 1]")
    if args.out is None and not args.quick:
        args.out = RESULTS_DIR / ("engines_llamacpp.json" if args.llama_cpp else "engines_quanto.json")
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        p.error(f"--out {args.out}: must be a file in an existing folder")
    torch.manual_seed(0)
    if args.llama_cpp:
        return llama(args)
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
    write_json(args.out, doc)
    print(json.dumps({k: {"identical": f"{v['identical']}/{v['prompts']}", "mean_kl": round(v["mean_kl"], 4)}
                      for k, v in res.items()}))
    return doc


def llama(args) -> dict:
    from transformers import AutoTokenizer

    from kvlab.models import smollm2_folder, smollm2_gguf

    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    kw = dict(lengths=args.lengths, depths=args.depths, trials=args.trials)
    if args.quick:
        kw = dict(cache_types=("f16",), lengths=[512], depths=[0.5], trials=1)
    t = time.time()
    res = engines.llamacpp_passkey(smollm2_gguf(), tok, progress=not args.quick, **kw)
    doc = {"what": "llama.cpp (llama-cpp-python) running SmolLM2-135M-Instruct's GGUF file (Q4_1 weights) with K and "
                   "V cache types f16 / q8_0 / q4_0, flash attention on; passkey exact match on chapter 4's sweep "
                   "prompts (filler haystack), fed as token ids",
           "lengths": kw["lengths"], "depths": kw["depths"], "trials": kw["trials"], "cache_types": res,
           "versions": {"llama-cpp-python": md.version("llama-cpp-python"), "torch": torch.__version__},
           "build": os.environ.get("CMAKE_ARGS", ""), "machine": cpu_model(), "threads": os.cpu_count(),
           "seconds": round(time.time() - t), "date": dt.date.today().isoformat()}
    if args.out is not None:
        write_json(args.out, doc)
    print(json.dumps({ct: sum(r["correct"] for r in v["rows"]) for ct, v in res.items()}))
    return doc


if __name__ == "__main__":
    main()
