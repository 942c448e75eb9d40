"""Run the real engines kvlab's presets mirror beside kvlab, and write what they measured.

``--llama-cpp``: llama.cpp (``llama-cpp-python``, built by ``make peers``) runs SmolLM2's GGUF file itself
with K and V cache types f16, q8_0 and q4_0 (flash attention on), on the passkey prompts of chapter 4's
sweep (:func:`kvlab.engines.llamacpp_passkey`). Writes ``data/results/engines_llamacpp.json``; chapter 4
puts it beside kvlab's emulation of the same cache types. ``--quick`` runs only the first case (f16, one
prompt at 512 tokens) and writes nowhere unless ``--out`` is given.

``--llama-cpp --model gemma3-270m``: the same on Gemma 3 270M's GGUF file (Q4_K_M weights), by default at
8,192 tokens on the prompts of the long sweep's filler stage (``scripts/sweep_long.py``: same seed, depths and
prompts a depth), so each answer pairs with kvlab's on the identical prompt. Writes
``data/results/engines_llamacpp_gemma3.json`` after every prompt, and a rerun with the same depths and trials
resumes it: the cells it holds are kept, a cell cut off part way goes on at its next prompt, new lengths are added
(32,768 tokens takes hours on 2 cores).

``--llama-server``: the same comparison the way a reader would run it against real deployments: two
llama.cpp servers (``python -m llama_cpp.server``, OpenAI-compatible) on the same GGUF, one with an f16
cache and one with q4_0, on loopback, measured with ``kvlab niah --endpoint ... --compare ...``. Writes
``data/results/engines_llamacpp_server.json`` (the side-by-side JSON plus versions and machine).

``--hqq``: the same with ``QuantizedCache(backend="hqq")`` (the ``hqq`` package), written to
``data/results/engines_hqq.json``; its grouping differs from every kvlab preset by design (see
:mod:`kvlab.engines`).

``--quanto``: ``transformers``' ``QuantizedCache`` with the quanto backend (``optimum-quanto``) vs the
``hf-int4`` / ``hf-int2`` presets on SmolLM2-135M-Instruct, same passkey prompts, one shared prefill
(:func:`kvlab.engines.quanto_side_by_side`). Writes ``data/results/engines_quanto.json`` with the
versions, machine and run time; chapter 4 reads it.

    python scripts/compare_engines.py --quanto [--lengths 512 1024 2048] [--trials 5]
    python scripts/compare_engines.py --hqq [--lengths 512 1024 2048] [--trials 5]
    python scripts/compare_engines.py --llama-cpp [--lengths 512 2048] [--trials 5]   # 8192 adds ~45 min on 2 cores
    python scripts/compare_engines.py --llama-cpp --model gemma3-270m [--lengths 8192 32768] [--cache-types f16 q4_0] [--swa-cache window]
    python scripts/compare_engines.py --llama-server [--lengths 512 2048] [--trials 3]
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import json
import os
import sys
import time
from pathlib import Path

from kvlab.cli import MAX_LENGTH, Parser, float_flag, int_flag, path_flag
from kvlab.env import cpu_model
from kvlab.formats import LLAMA_CACHE_TYPES
from kvlab.paths import RESULTS_DIR, out_problem, read_json, write_json
from kvlab.results import llamacpp_doc_problem, llamacpp_unresumed

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> dict:
    p = Parser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--quanto", action="store_true", help="transformers' QuantizedCache (quanto)")
    which.add_argument("--hqq", action="store_true", help="transformers' QuantizedCache (HQQ backend)")
    which.add_argument("--llama-cpp", action="store_true", help="llama.cpp on the GGUF file (make peers)")
    which.add_argument("--llama-server", action="store_true",
                       help="two llama.cpp servers (f16, q4_0 cache) compared with kvlab niah --endpoint")
    p.add_argument("--model", choices=["smollm2-135m", "gemma3-270m"], default="smollm2-135m",
                   help="llama.cpp: whose GGUF file runs (gemma3-270m pairs with the long sweep's prompts)")
    p.add_argument("--lengths", type=int_flag(64, MAX_LENGTH), nargs="+", default=None)
    p.add_argument("--depths", type=float_flag(0, 1), nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int_flag(1, 1000), default=5)
    p.add_argument("--new-tokens", type=int_flag(2, 4096), default=8)
    p.add_argument("--cache-types", nargs="+", choices=list(LLAMA_CACHE_TYPES), default=None,
                   help="llama.cpp: which K/V cache types run, in this order (default: all)")
    p.add_argument("--swa-cache", choices=["full", "window"], default=None,
                   help="llama.cpp: a sliding-window layer's cache holds the whole context ('full', llama-cpp-python's "
                        "default) or its window only ('window': much faster at 32k on a CPU, same answers in principle)")
    p.add_argument("--quick", action="store_true", help="llama.cpp: the first case only (a smoke test)")
    p.add_argument("--out", type=path_flag, default=None)
    args = p.parse_args(argv)
    if args.out is not None and (why := out_problem(args.out)):  # before the run, not after it
        p.error(why)
    gemma = args.model == "gemma3-270m"
    if gemma and not args.llama_cpp:
        p.error("--model gemma3-270m is for --llama-cpp")
    if args.swa_cache and not args.llama_cpp:
        p.error("--swa-cache is for --llama-cpp")
    if args.cache_types and not args.llama_cpp:
        p.error("--cache-types is for --llama-cpp")
    if args.quick and not args.llama_cpp:
        p.error("--quick is for --llama-cpp (a smoke test of its first case)")
    if args.quick and (args.lengths or args.depths != p.get_default("depths") or args.trials != p.get_default("trials")
                       or args.cache_types):
        p.error("--quick runs one fixed case (f16, 512 tokens, depth 0.5, one trial): drop --lengths, --depths, "
                "--trials and --cache-types")
    if args.llama_cpp and args.lengths:  # llama.cpp would take a longer prompt and answer past the model's window
        from kvlab.budget import load_shape

        window = load_shape("gemma-3-270m" if gemma else "smollm2-135m").max_position_embeddings
        if max(args.lengths) > window:
            p.error(f"--lengths {max(args.lengths)}: past {args.model}'s {window:,}-token window")
    if args.llama_cpp and args.new_tokens != p.get_default("new_tokens"):
        p.error("--new-tokens is not for --llama-cpp: its passkey run does not read it")
    if (args.quanto or args.hqq) and args.depths != p.get_default("depths"):
        p.error("--depths is not for --quanto or --hqq: their prompts put the needle at depth 0.5")
    if not args.lengths:  # llama.cpp at 8192 tokens adds ~45 minutes on 2 cores: pass --lengths to include it
        args.lengths = [8192] if gemma else [512, 1024, 2048] if args.quanto or args.hqq else [512, 2048]
    if args.out is None and not args.quick:
        args.out = RESULTS_DIR / (("engines_llamacpp_gemma3.json" if gemma else "engines_llamacpp.json") if args.llama_cpp else "engines_llamacpp_server.json"
                                  if args.llama_server else "engines_hqq.json" if args.hqq else "engines_quanto.json")
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        p.error(f"--out {args.out}: must be a file in an existing folder")
    for flag in ("lengths", "depths", "cache_types"):  # a value twice would run (and count) its prompts twice
        vals = getattr(args, flag) or []
        if len(set(vals)) < len(vals):
            p.error(f"--{flag.replace('_', '-')} lists {next(v for v in vals if vals.count(v) > 1)} twice")
    args.resumed = None  # an earlier llama.cpp run in --out, read (and checked) before any work; llama() resumes it
    if args.llama_cpp and args.out is not None and args.out.is_file():
        if args.quick:
            p.error(f"--out {args.out} already holds a file: --quick would replace it with a smoke test; give a new path")
        try:
            old = read_json(args.out, "--out", {"cache_types": dict, "lengths": list, "runs": list})
        except ValueError as e:
            p.error(str(e))
        if why := llamacpp_doc_problem(old):
            p.error(f"--out {args.out}: {why}; move it away")
        # a resume keeps every row, so it must be the same experiment; anything else is refused, never replaced
        was = {"model": old.get("model", "smollm2-135m"),  # files from before --model ran SmolLM2
               "depths": sorted(float(d) for d in old["depths"]), "trials": old["trials"]}
        now = {"model": args.model, "depths": sorted(float(d) for d in args.depths), "trials": args.trials}
        if diff := [k for k in was if was[k] != now[k]]:
            p.error(f"--out {args.out} holds a run with other settings ("
                    + ", ".join(f"{k} {was[k]} there, {now[k]} here" for k in diff)
                    + "): pass the same to resume it, or give a new --out")
        swa = None if args.swa_cache is None else args.swa_cache == "full"
        if why := llamacpp_unresumed(old["cache_types"], tuple(args.cache_types or LLAMA_CACHE_TYPES), args.lengths,
                                     args.depths, args.trials, swa):  # the run would overwrite it
            p.error(f"--out {args.out} holds {why}: resume it with its length among --lengths and the --swa-cache "
                    "that wrote it (none: llama-cpp-python's default; False: window), or give a new --out")
        args.resumed = old
    import torch  # after the flags are checked: a refusal comes in well under a second, not after torch loads

    from kvlab import engines
    from kvlab.models import load_model

    torch.manual_seed(0)
    if args.llama_cpp:
        return llama(args)
    if args.llama_server:
        return llama_server(args)
    model, tok = load_model()
    t = time.time()
    backend, package = ("hqq", "hqq") if args.hqq else ("quanto", "optimum-quanto")
    res = engines.quanto_side_by_side(model, tok, lengths=tuple(args.lengths), trials=args.trials,
                                      new_tokens=args.new_tokens, progress=True, backend=backend)
    doc = {"what": f"transformers QuantizedCache(backend='{backend}') vs kvlab's matching preset, SmolLM2-135M-Instruct, "
                   "passkey prompts (filler haystack, needle at depth 0.5), one shared full-precision prefill",
           "backend": backend,
           "lengths": args.lengths, "trials": args.trials, "new_tokens": args.new_tokens,
           "formats": {k: {**v, "engine": {str(n): c for n, c in v["engine"].items()},
                           "kvlab": {str(n): c for n, c in v["kvlab"].items()}} for k, v in res.items()},
           "versions": {p_: md.version(p_) for p_ in ("transformers", package, "torch")},
           "machine": cpu_model(), "threads": torch.get_num_threads(), "seconds": round(time.time() - t),
           "date": dt.date.today().isoformat()}
    write_json(args.out, doc)
    print(json.dumps({k: {"identical": f"{v['identical']}/{v['prompts']}", "mean_kl": round(v["mean_kl"], 4)}
                      for k, v in res.items()}))
    return doc


def llama(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from kvlab import engines
    from kvlab.models import gemma3_folder, gemma3_gguf, smollm2_folder, smollm2_gguf
    from kvlab.results import llamacpp_answered, llamacpp_log_run

    gemma = args.model == "gemma3-270m"
    tok = AutoTokenizer.from_pretrained(gemma3_folder() if gemma else smollm2_folder())
    kw = dict(lengths=args.lengths, depths=args.depths, trials=args.trials,
              cache_types=tuple(args.cache_types or LLAMA_CACHE_TYPES))
    if args.quick:
        kw = dict(cache_types=("f16",), lengths=[512], depths=[0.5], trials=1)
    who = ("Gemma 3 270M's GGUF file (Q4_K_M weights)" if gemma
           else "SmolLM2-135M-Instruct's GGUF file (Q4_1 weights)")
    prompts = ("the long sweep's filler-stage prompts (scripts/sweep_long.py, seed 0)" if gemma
               else "chapter 4's sweep prompts (filler haystack)")
    doc = {"what": f"llama.cpp (llama-cpp-python) running {who} with K and V cache types f16 / q8_0 / q4_0, flash "
                   f"attention on; passkey exact match on {prompts}, fed as token ids",
           "model": args.model, "lengths": list(kw["lengths"]), "depths": kw["depths"], "trials": kw["trials"],
           "cache_types": {}}
    # an earlier run with the same model, depths and trials is resumed: its rows are kept, its lengths added
    old = args.resumed  # checked in main: the same model, depths and trials
    if old is not None:
        doc["lengths"] = sorted(set(old["lengths"]) | set(doc["lengths"]))
        doc["cache_types"] = old["cache_types"]
        print(f"resuming {args.out}: {sum(len(v['rows']) for v in old['cache_types'].values())} rows kept")

    # each session that adds prompts logs its machine, dates and counts: a file resumed elsewhere stays truthful
    runs = list(old.get("runs", [])) if old is not None else []
    started = dt.date.today().isoformat()
    before = llamacpp_answered(doc["cache_types"])
    sec_before = {ct: float(v.get("seconds", 0.0)) for ct, v in doc["cache_types"].items()}

    def save(res):
        today = dt.date.today().isoformat()
        doc.update(cache_types=res, versions={"llama-cpp-python": md.version("llama-cpp-python"),
                                              "torch": torch.__version__},
                   build=os.environ.get("CMAKE_ARGS", ""), machine=cpu_model(), threads=os.cpu_count(),
                   seconds=round(sum(v["seconds"] for v in res.values())), date=today,
                   runs=llamacpp_log_run(runs, before, res, sec_before, machine=cpu_model(), threads=os.cpu_count(),
                                         dates=[started, today]))
        if args.out is not None:
            write_json(args.out, doc)

    swa = None if args.swa_cache is None else args.swa_cache == "full"
    res = engines.llamacpp_passkey(gemma3_gguf() if gemma else smollm2_gguf(), tok, progress=not args.quick,
                                   done=doc["cache_types"], on_row=save, swa_full=swa, **kw)
    save(res)
    print(json.dumps({ct: sum(r["correct"] for r in v["rows"]) for ct, v in res.items()}))
    return doc


def llama_server(args) -> dict:
    """Two llama.cpp servers on loopback (f16 and q4_0 K/V cache), compared by :func:`kvlab.endpoint.compare`
    (what ``kvlab niah --endpoint URL --compare URL2`` runs)."""
    import socket
    import subprocess
    import tempfile

    import httpx
    from transformers import AutoTokenizer

    from kvlab import endpoint
    from kvlab.models import smollm2_folder, smollm2_gguf

    try:
        import llama_cpp
        import llama_cpp.server.app  # noqa: F401  (the [server] extra: fastapi, uvicorn, ...)
    except ImportError:
        raise SystemExit("needs llama-cpp-python[server]: `make peers` installs it") from None
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    if args.quick:
        args.lengths, args.depths, args.trials = [256], [0.5], 1
    procs, urls = [], {}
    log = Path(tempfile.mkdtemp()) / "llama-server.log"
    try:
        for ct, code in types.items():
            with socket.socket() as s_:
                s_.bind(("127.0.0.1", 0))
                port = s_.getsockname()[1]
            cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf()), "--model_alias",
                   "smollm2", "--type_k", str(code), "--type_v", str(code), "--flash_attn", "true",
                   "--n_ctx", str(max(args.lengths) + 64), "--n_threads", "1", "--n_threads_batch", "1",
                   "--host", "127.0.0.1", "--port", str(port)]
            procs.append(subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT))
            urls[ct] = f"http://127.0.0.1:{port}"
        for ct, u in urls.items():  # wait until each answers, or say why not
            for _ in range(240):
                try:
                    if httpx.get(u + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if any(p_.poll() is not None for p_ in procs):
                    raise SystemExit(f"a llama.cpp server exited; see {log}")
                time.sleep(0.5)
            else:
                raise SystemExit(f"llama.cpp server ({ct}) did not answer within 120 s; see {log}")
        journal = Path(tempfile.mkdtemp()) / "llama_server.requests.jsonl"  # the run's journal: not data to ship
        tok = AutoTokenizer.from_pretrained(smollm2_folder())
        t = time.time()
        doc = endpoint.compare([endpoint.Endpoint(urls["f16"]), endpoint.Endpoint(urls["q4_0"])], tok, journal,
                               lengths=args.lengths, depths=args.depths, trials=args.trials,
                               max_tokens=args.new_tokens, top_logprobs=5, concurrency=2, progress=True)
    finally:
        for p_ in procs:
            p_.terminate()
            p_.wait(timeout=30)
    doc |= {"what": "two llama.cpp servers (llama-cpp-python's OpenAI-compatible server) on SmolLM2-135M-Instruct's "
                    "GGUF, K/V cache f16 (teacher) and q4_0 (student), flash attention on, one thread each; "
                    "compared with `kvlab niah --endpoint URL --compare URL2` on chapter 4's passkey prompts",
            "labels": {urls["f16"]: "llama.cpp f16 cache", urls["q4_0"]: "llama.cpp q4_0 cache"},
            "versions": {"llama-cpp-python": md.version("llama-cpp-python"), "kvlab": md.version("kvlab")},
            "machine": cpu_model(), "seconds": round(time.time() - t), "date": dt.date.today().isoformat()}
    if args.out is not None:
        write_json(args.out, doc)
    print(json.dumps({doc["labels"][u]: sum(r["correct"] for r in v["rows"]) for u, v in doc["results"].items()}))
    return doc


if __name__ == "__main__":
    main()
