"""Regenerate chapter 4's data: every KV format on every rung of the eval ladder, on SmolLM2-135M-Instruct.

Writes ``data/results/eval_sweep.json`` (rewritten after every step, so a partial
run is readable and nothing measured is lost):

* passkey exact match over context length x needle depth, in two haystacks —
  repeated filler sentences and held-out prose;
* a slice with the prompt itself quantized during prefill (``prefill="cached"``);
* a 2-hop chain probe in full precision (the rung is kept only if the model can climb it);
* held-out perplexity with every token reading the quantized cache;
* a side-by-side with the full-precision teacher on long golden prompts;

plus how long each part took, on what machine, with which versions.

    python scripts/sweep_evals.py            # the shipped sweep (about 95 minutes on 2 CPU cores)
    python scripts/sweep_evals.py --resume   # finish an interrupted run: steps already in the file are kept
    python scripts/sweep_evals.py --quick    # a small slice, for a smoke test
"""

from __future__ import annotations

import time
from pathlib import Path

from kvlab.cli import Parser, model_flag, model_problem, path_flag
from kvlab.env import machine as env_machine
from kvlab.facts import LADDER_PPL_WINDOWS
from kvlab.formats import KVFormat, format_names, get_format, mitigations
from kvlab.paths import out_problem, read_json, write_json

ROOT = Path(__file__).resolve().parents[1]

CORE = ["fp32", "fp8_e4m3", "int8", "int4_tensor", "int4_token", "int4", "q4_0", "kivi-2"]
# formats swept with the prompt's own attention reading the quantized cache (vLLM's and llama.cpp's prefill)
CACHED = ["int4_token", "int4", "kivi-2", "int4_tensor", "fp8_e4m3", "int8", "q4_0"]


def all_formats() -> list[KVFormat]:
    """Every preset, then the INT4 mitigations (:func:`kvlab.formats.mitigations`), each once."""
    return [get_format(n) for n in dict.fromkeys(format_names() + [f.name for f in mitigations()])]


def machine() -> str:
    import torch

    return env_machine(torch.get_num_threads())


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small slice (smoke test)")
    p.add_argument("--out", type=path_flag, default=ROOT / "data" / "results" / "eval_sweep.json")
    p.add_argument("--model", type=model_flag, default=None, help="a name kvlab knows or a Hugging Face folder (default: smollm2-135m)")
    p.add_argument("--resume", action="store_true", help="keep the steps --out already holds and run the rest")
    args = p.parse_args(argv)
    if args.out is not None and (why := out_problem(args.out)):  # before the run, not after it
        p.error(why)
    if args.out.exists() and args.out.is_dir():
        p.error(f"--out {args.out} is a directory")
    old = None  # with --resume, the sweep in --out, read (and checked) before any work
    if args.resume and args.out.is_file():
        try:
            old = read_json(args.out, "--out", {"steps": dict, "formats": dict})
        except ValueError as e:
            p.error(str(e))
        if "steps" not in old:
            p.error(f"--out {args.out}: not a sweep this script wrote (no steps); move it away")
    from kvlab.models import DEFAULT_MODEL, load_model

    args.model = DEFAULT_MODEL if args.model is None else args.model
    if why := model_problem(args.model):  # before torch loads
        p.error(why)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import torch  # after the flags are checked: a refusal comes in well under a second, not after torch loads
    import transformers

    from kvlab import evals
    try:
        model, tok = load_model(args.model)
    except (ValueError, OSError) as e:  # an unknown name or a folder without a model: one line
        p.error(f"--model: {e}")
    fmts = all_formats()
    if args.quick:
        fmts = [get_format(n) for n in ("fp32", "int8", "int4_tensor")]
        lengths, prose_lengths, depths, per_depth = [256, 512], [512], [0.0, 1.0], 1
    else:
        lengths, prose_lengths, depths, per_depth = [512, 2048, 8192], [512, 2048], [0.0, 0.25, 0.5, 0.75, 1.0], 5
    core = [f for f in fmts if f.name in CORE]
    t0 = time.time()
    out = {"model": args.model, "lengths": lengths, "prose_lengths": prose_lengths, "depths": depths,
           "trials": per_depth, "prefill": "full", "machine": machine(), "torch": torch.__version__,
           "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"), "steps": {},
           "formats": {f.name: {"source": f.source, "bits_per_element": f.bits_per_element(64),
                                "passkey": [], "passkey_prose": []} for f in fmts}}

    if old is not None:
        same = all(old.get(k) == out[k] for k in ("model", "lengths", "depths", "trials", "prefill"))
        if not same or set(old.get("formats", {})) != set(out["formats"]):
            p.error(f"--resume: {args.out} holds a different sweep (model, grid or formats); move it away first")
        out, t0 = old | {"prose_lengths": prose_lengths}, time.time() - old.get("seconds", 0)
        print("resuming; done:", ", ".join(out["steps"]), flush=True)

    def done(step):
        return step in out["steps"]

    def save(step, t):
        out["steps"][step] = round(time.time() - t, 1)
        out["seconds"] = round(time.time() - t0, 1)
        write_json(args.out, out)  # atomic: an interrupted sweep keeps its last complete file
        print(f"[{out['seconds']:7.0f}s] {step} ({out['steps'][step]}s)", flush=True)

    # 1. passkey, filler haystack, every format; one length at a time so a partial file is useful
    for n in lengths:
        if done(f"passkey filler {n}"):
            continue
        t = time.time()
        res = evals.passkey_sweeps(model, tok, fmts, [n], depths, per_depth, seed=0)
        for name, r in res.items():
            out["formats"][name]["passkey"] += r.rows
        save(f"passkey filler {n}", t)
    # 2. the teacher side by side on long golden prompts, and perplexity (every token reads the cache)
    t = time.time()
    golden = [] if done("teacher") else evals.golden_prompts(tok, n=1 if args.quick else 2, length=256 if args.quick else 1024)
    if golden:
        for name, row in evals.teacher_comparisons(model, tok, fmts, golden, max_new_tokens=16).items():
            out["formats"][name]["teacher"] = row
        save("teacher", t)
    t = time.time()
    if not done("perplexity"):
        for f in fmts:
            out["formats"][f.name]["perplexity"] = evals.perplexity(model, tok, f, window=512,
                                                                    max_windows=2 if args.quick else LADDER_PPL_WINDOWS)
        save("perplexity", t)
    # 3. the harsher mode: the prompt's own attention reads the quantized cache
    t = time.time()
    have = out.setdefault("prefill_cached", {})
    cached = [f for f in core if f.name in CACHED and f.name not in have]  # a resumed sweep adds only what is missing
    if cached:
        res = evals.passkey_sweeps(model, tok, cached, [2048 if not args.quick else 512], depths,
                                   1 if args.quick else 2, seed=0, prefill="cached")
        have.update({name: r.rows for name, r in res.items()})
        save("passkey, prompt quantized during prefill" + (f" ({len(cached)} formats)" if len(have) > len(cached) else ""), t)
    # 4. multi-hop, in full precision first: a rung the model cannot climb ranks nothing
    t = time.time()
    if not done("2-hop chain, fp32"):
        ch = evals.chain_sweep(model, tok, "fp32", [512], [1.0], hops=2, trials=4 if args.quick else 10, seed=0)
        out["chain2_fp32"] = ch.rows
        save("2-hop chain, fp32", t)
    # 5. passkey, real prose haystack, every format (the same prompts for all; formats already swept are kept)
    for n in prose_lengths:
        todo = [f for f in fmts if not any(r["length"] == n for r in out["formats"][f.name]["passkey_prose"])]
        if not todo:
            continue
        t = time.time()
        res = evals.passkey_sweeps(model, tok, todo, [n], depths, per_depth, seed=1, haystack="prose")
        for name, r in res.items():
            out["formats"][name]["passkey_prose"] += r.rows
        save(f"passkey prose {n}" + ("" if len(todo) == len(fmts) else f" ({len(todo)} formats)"), t)
    print(f"wrote {args.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
