"""Regenerate chapter 4's long-context data: every KV format on identical prompts from 1k to 32k tokens.

The long-context model is Gemma 3 270M (32,768-token window); SmolLM2 (8,192) works too with
``--model smollm2-135m --lengths 1024 4096 8192``. One JSON object per prompt is appended to
``--out`` (JSON Lines) as soon as it is measured, so an interrupted run loses at most the prompt in
flight, and ``--resume`` (the default when the file exists) skips every prompt already there.

Stages, in the order they run (the first answers the headline question soonest):

1. ``filler``: passkey in repeated filler sentences, the prompt attending in full precision and only
   the stored cache quantized (``transformers``' ``QuantizedCache`` does this); one chunked prefill per
   prompt serves every format, and each format's answer is decoded greedily from its own cache;
2. ``perplexity``: held-out text in windows of 512 tokens, every token reading the quantized cache
   (as if decoded one by one), the summed negative log-likelihood of each window per format;
3. ``prose``: the same passkey in English text (:data:`kvlab.tasks.CORPUS_SOURCE`, or ``--haystack-file``);
4. ``cached``: the prompt itself reading the quantized cache chunk by chunk (vLLM V1 and llama.cpp
   write K and V to the cache before attending), one prefill per format, at 8k and 32k;
5. ``multikey``: a harder rung (RULER's multi-key needle): two named pass keys in the filler haystack, the
   one asked for at the sweep's depth and the other at a random sentence boundary
   (:func:`kvlab.tasks.multikey`), at 4k and 8k;
6. ``orders``: a product-like rung: order records among retrieved documents (the prose haystack), a question
   about one customer's order answered with a city name (:func:`kvlab.tasks.order_lookup`).

Each record holds ``correct[format]`` (exact match of the 5-digit key), so any two formats can be
compared prompt by prompt (exact McNemar: :func:`kvlab.results.mcnemar`). ``--add-formats`` measures more
formats later on the same prompts and appends them (:class:`kvlab.results.LongSweep` merges them in).

    python scripts/sweep_long.py                 # the shipped sweep (many hours on 2 CPU cores; resumable)
    python scripts/sweep_long.py --quick --out /tmp/q.jsonl   # a smoke test of a few minutes
    python scripts/sweep_long.py --model smollm2-135m --out data/results/long_sweep_smollm2.jsonl \
        --add-formats fp8_e5m2 --stages perplexity filler      # one more format, the same prompts
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from kvlab.cli import MAX_LENGTH, Parser, int_flag, model_problem, path_flag
from kvlab.paths import out_problem, read_text

ROOT = Path(__file__).resolve().parents[1]

DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
LENGTHS = [1024, 4096, 8192, 32768, 16384]  # 32k before 16k: the headline first
CORE = ["fp32", "fp8_e4m3", "int8", "q8_0", "int4", "int4_token", "int4_tensor", "q4_0", "kivi-4", "kivi-2"]
CACHED = ["fp8_e4m3", "int8", "q4_0", "int4_token"]
CACHED_LENGTHS = [8192, 32768]
MULTIKEY_LENGTHS = ORDER_LENGTHS = [4096, 8192]
# per-layer-type mixes on a hybrid model: INT4 only where the layer attends globally, or only on the windows
# (kvlab.formats resolves these names: int4_token on one layer type, full precision on the others)
MIXED = ["int4_token@global", "int4_token@sliding"]
SEEDS = {"filler": 0, "cached": 0, "prose": 1, "multikey": 2, "orders": 3}  # cached shares the filler prompts
MODES = {"filler": "full", "prose": "full", "cached": "cached", "multikey": "full", "orders": "full"}
HAYSTACK = {"filler": "filler", "cached": "filler", "multikey": "filler", "prose": "prose", "orders": "prose"}


def plan_of(args, lengths: list[int]) -> list[tuple[str, int]]:
    """The (stage, length) pairs a run measures, in order (perplexity aside)."""
    plan = [(s, n) for s in ("filler", "prose") if s in args.stages for n in lengths]
    for stage, own in (("cached", CACHED_LENGTHS), ("multikey", MULTIKEY_LENGTHS), ("orders", ORDER_LENGTHS)):
        if stage in args.stages:
            plan += [(stage, n) for n in (own if not args.quick else lengths[-1:]) if n in lengths]
    return plan


def prompt_maker(stage: str, hay: list[int]):
    """The function that builds ``stage``'s prompts, ``make(tok, length, depth, rng)``; the prose and orders stages
    cut their haystack from ``hay`` (token ids), the filler and cached stages share the filler passkey's."""
    from kvlab import tasks

    return {"prose": lambda t, n, d, r: tasks.passkey(t, n, d, r, haystack=hay),
            "multikey": lambda t, n, d, r: tasks.multikey(t, n, d, r, keys=tasks.MULTIKEY_KEYS),
            "orders": lambda t, n, d, r: tasks.order_lookup(t, n, d, r, records=tasks.ORDER_RECORDS, haystack=hay),
            }.get(stage, tasks.passkey)


def _resume_lines(path: Path, p) -> tuple[list[dict], bool]:
    """The records of a sweep file to resume, and whether its last line was cut off mid-record (the run was
    killed while writing it: :func:`_drop_cut_line` drops it once the file is known to be this sweep's, since
    its prompt will simply run again). Any other damage stops the run with one line rather than appending to
    a file that is not a sweep. The file is not changed here."""
    text = path.read_text(encoding="utf-8", errors="replace")
    raw = text.splitlines()
    lines, cut = [], False
    for i, x in enumerate(raw, start=1):
        if not x.strip():
            continue
        try:
            rec = json.loads(x)
        except (ValueError, RecursionError) as e:  # not JSON, too deep, or an integer of thousands of digits
            if i == len(raw) and i > 1 and not text.endswith("\n"):
                cut = True
                break
            why = getattr(e, "msg", None) or type(e).__name__
            p.error(f"{path}:{i} is not a sweep record ({why}); move the file away or fix it")
        if isinstance(rec, dict) and i > 1 and rec.get("kind") == "formats" and isinstance(rec.get("formats"), dict):
            lines.append(rec)  # formats added later (--add-formats)
            continue
        if not isinstance(rec, dict) or (i == 1) != (rec.get("kind") == "header") or (
                i > 1 and not all(k in rec for k in ("stage", "length", "depth", "index"))):
            p.error(f"{path}:{i} is not a sweep {'header' if i == 1 else 'record'}; move the file away or fix it")
        lines.append(rec)
    if not lines:
        p.error(f"{path} holds no sweep header; move the file away")
    return lines, cut


def _drop_cut_line(path: Path) -> None:
    """Drop the last line of ``path``, cut off mid-write (see :func:`_resume_lines`)."""
    print(f"{path}: dropping a last record cut off mid-write (a run killed while writing it); the sweep, or "
          "--add-formats if it was an added record, measures that prompt again", flush=True)
    with path.open("r+b") as f:
        f.truncate(path.read_bytes().rfind(b"\n") + 1)


def _answer(model, ex, fmts, stage: str, chunk: int) -> dict:
    """One prompt's answer in every format of ``fmts``: ``{"key": ..., "correct": {format: exact match}}``."""
    import torch

    from kvlab import evals

    want = torch.tensor([ex.answer_ids])
    gens = evals.answers(model, torch.tensor([ex.input_ids]), fmts, want.shape[1], MODES[stage], want, chunk)
    return {"key": ex.answer, "correct": {name: g[0].tolist() == ex.answer_ids for name, g in gens.items()}}


def _format_entry(f, head_dim: int) -> dict:
    return {"source": f.source, "bits_per_element": f.bits_per_element(head_dim), "layer_formats": f.layer_names}


def _definition(entry: dict) -> tuple:
    """What must not change between two runs that write one format's records: its bits and per-layer formats."""
    return entry.get("bits_per_element"), entry.get("layer_formats")


def _provenance() -> dict:
    """Where and with what a run measured (every header and formats line records it)."""
    import torch
    import transformers

    from kvlab.env import machine

    return {"machine": machine(torch.get_num_threads()), "torch": torch.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}


def _append(f, rec: dict) -> None:
    """One record, on disk before the next is measured (a run killed later loses nothing written)."""
    f.write(json.dumps(rec, allow_nan=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _windows(tok, quick: bool, count: int):
    from kvlab import evals

    return evals.perplexity_windows(tok, window=128 if quick else 512, max_windows=count)


def _window_record(model, x, i: int, fmts) -> dict:
    """Held-out window ``i`` (token ids ``x``) read by every format of ``fmts``, each token reading its cache:
    the summed negative log-likelihood per format."""
    from kvlab import evals

    return {"stage": "perplexity", "haystack": "heldout", "prefill": "cached", "length": x.shape[1], "depth": 0.0,
            "index": i, "tokens": x.shape[1] - 1, "nll": {f.name: round(evals.window_nll(model, x, f), 4) for f in fmts}}


def _needle_head(stage: str, n: int, d: float, i: int) -> dict:
    """The fields that name one passkey prompt of a stage."""
    return {"stage": stage, "haystack": HAYSTACK[stage], "prefill": MODES[stage], "length": n, "depth": float(d), "index": i}


REFERENCE_TOLERANCE = 1e-3  # relative: full precision's NLL on a held-out window, then and now (a thread count or
# library change moves it by about 1e-5; a different window by far more than 1e-3)


def add_formats(args, p, model, tok, hay, header: dict, names: list[str]) -> None:
    """``--add-formats``: measure ``names`` on the prompts the sweep file already holds, rebuilt from their seeds.

    Before anything is written, the file is read and checked whole (:meth:`kvlab.results.LongSweep.load`) and
    every prompt to measure is rebuilt and its pass key compared with the one stored; while measuring, full
    precision runs again beside the new formats and must give the stored answer on each prompt (on each held-out
    window, the stored NLL within :data:`REFERENCE_TOLERANCE`), so a changed tokenizer, haystack or prompt code
    stops the run instead of pairing different prompts. Appends one ``{"kind": "formats"}`` line, then one record
    marked ``"added"`` per prompt, as it goes; run again to resume. The stages in ``--stages`` (and the lengths in
    ``--lengths``, if given) are measured, held-out perplexity first, then by length. (The prompt-reads-the-cache
    stage has no full-precision answers of its own: its prompts are the filler stage's, checked there.)"""
    from kvlab import tasks
    from kvlab.formats import get_format
    from kvlab.results import LongSweep, outcome_field

    lines, cut = _resume_lines(args.out, p)
    old = lines[0]
    for k in ("model", "depths", "per_depth", "haystacks", "chunk"):  # before anything is changed in the file
        if old.get(k) != header[k]:
            p.error(f"--add-formats: {args.out} was swept with {k} {old.get(k)!r}, this command gives {header[k]!r}; "
                    "pass the sweep's own --model, --per-depth, --chunk, --haystack-file (and --quick)")
    if cut:
        _drop_cut_line(args.out)  # an interrupted run's last line
    try:
        sweep = LongSweep.load(args.out)
    except ValueError as e:
        p.error(f"--add-formats: {e}; fix the file or run the sweep again into a new one")
    if clash := [n for n in names if n in sweep.formats]:
        p.error(f"--add-formats: {clash} are in the sweep already")
    fmts = [get_format(n) for n in names]
    for f in fmts:  # added before (a resumed run): the same format, or its records would mix two definitions
        if f.name in sweep.added_formats:
            then, now = _definition(sweep.format_entry(f.name)), _definition(_format_entry(f, model.config.head_dim))
            if then != now:
                p.error(f"--add-formats: {f.name} was added as {then[0]} bits {then[1]}, and is {now[0]} bits {now[1]} now")
    new = {f.name: _format_entry(f, model.config.head_dim) for f in fmts if f.name not in sweep.all_formats}
    base = {(r["stage"], r["length"], r["depth"], r["index"]): r for r in sweep.records}
    field = {k: outcome_field(k[0]) for k in base}
    order = ["perplexity", "filler", "prose", "multikey", "orders", "cached"]
    todo = sorted((k for k in base if k[0] in args.stages and set(names) - set(base[k][field[k]])
                   and (k[0] == "perplexity" or not args.lengths or k[1] in args.lengths)),
                  key=lambda k: (order.index(k[0]), k[1], k[2], k[3]))
    print(f"adding {names}: {len(todo)} prompts to measure", flush=True)
    # every prompt rebuilt and checked before a line is written
    wins, exs = None, {}
    if any(k[0] == "perplexity" for k in todo):
        count = 1 + max(k[3] for k in base if k[0] == "perplexity")
        wins = _windows(tok, args.quick, count)
    for stage, n, d, i in todo:
        if stage == "perplexity":
            if i >= len(wins) or wins[i].shape[1] != n:
                p.error(f"--add-formats: held-out window #{i} is not the {n}-token window the sweep read: the "
                        "held-out text or tokenizer changed")
            continue
        if (stage, n, d) not in exs:
            exs[(stage, n, d)] = tasks.sweep_prompts(prompt_maker(stage, hay), tok, n, d, header["per_depth"],
                                                     seed=SEEDS[stage])
        have = base[(stage, n, d, i)].get("key")
        if i >= len(exs[(stage, n, d)]) or exs[(stage, n, d)][i].answer != have:
            got = exs[(stage, n, d)][i].answer if i < len(exs[(stage, n, d)]) else "no prompt"
            p.error(f"--add-formats: {stage} {n} d={d} #{i} rebuilds as {got!r}, the sweep has pass key {have!r}: "
                    "the prompts changed (tokenizer, corpus or prompt code)")
    ref = get_format("fp32")
    with args.out.open("a") as f:
        # the formats line goes in with the first record that passed its check (a refused run writes nothing)
        pending = {"kind": "formats", "formats": new} | _provenance() if new else None
        for key in todo:
            stage, n, d, i = key
            missing = [x for x in fmts if x.name not in base[key][field[key]]]
            t0 = time.time()
            if stage == "perplexity":
                rec = _window_record(model, wins[i], i, [ref, *missing])
                now, then = rec["nll"].pop("fp32"), base[key]["nll"]["fp32"]
                if abs(now - then) > REFERENCE_TOLERANCE * then:
                    p.error(f"--add-formats: full precision reads held-out window #{i} as {now} nats now, "
                            f"{then} in the sweep: not the same window; nothing more is added")
            else:
                ex = exs[(stage, n, d)][i]
                check = MODES[stage] == "full"  # full precision decodes from the same prefill: one more decode
                out = _answer(model, ex, [ref, *missing] if check else missing, stage, args.chunk)
                if check and out["correct"].pop("fp32") != base[key]["correct"]["fp32"]:
                    p.error(f"--add-formats: full precision answers {stage} {n} d={d} #{i} differently from the "
                            "sweep: not the same prompt (a changed haystack?); nothing more is added")
                rec = _needle_head(stage, n, d, i) | out
            if pending:
                _append(f, pending)
                pending = None
            _append(f, rec | {"seconds": round(time.time() - t0, 1), "added": True})
            print(f"added {stage} {n} d={d} #{i}: {time.time() - t0:.1f}s", flush=True)


def formats(quick: bool, hybrid: bool = True):
    """The formats swept. The per-layer-type mixes exist only on a hybrid model (``hybrid``: some
    layers attend through a sliding window); on a model whose layers all attend globally they would
    repeat a core format."""
    from kvlab.formats import get_format, mitigations

    if quick:
        return [get_format(n) for n in ("fp32", "int8", "int4_token")]
    fmts = [get_format(n) for n in CORE] + mitigations()
    return fmts + [get_format(n) for n in MIXED] if hybrid else fmts


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--out", type=path_flag, default=ROOT / "data" / "results" / "long_sweep.jsonl")
    p.add_argument("--lengths", type=int_flag(64, MAX_LENGTH), nargs="+", default=None)
    p.add_argument("--per-depth", type=int_flag(1, 1000), default=5, help="prompts per (length, depth); 5 depths")
    p.add_argument("--chunk", type=int_flag(1, MAX_LENGTH), default=1024, help="prefill chunk in tokens")
    p.add_argument("--haystack-file", type=path_flag, default=None,
                   help="a UTF-8 text file to cut the prose haystack from (default: the project's corpus)")
    p.add_argument("--stages", nargs="+", default=None, choices=["filler", "perplexity", "prose", "cached", "multikey", "orders"],
                   help="default: every stage; with --add-formats, perplexity filler prose (the prompt-reads-the-cache "
                        "stage prefills once per format)")
    p.add_argument("--windows", type=int_flag(1, 10_000), default=16, help="perplexity windows of 512 tokens (the held-out text)")
    p.add_argument("--quick", action="store_true", help="a small slice (smoke test)")
    p.add_argument("--add-formats", nargs="+", default=None, metavar="FORMAT",
                   help="measure these formats on the prompts --out already holds (rebuilt from their seeds and "
                        "checked against the stored pass keys) and append them; the stages in --stages, the "
                        "lengths in --lengths if given")
    args = p.parse_args(argv)
    args.stages = args.stages or (["perplexity", "filler", "prose"] if args.add_formats else
                                  ["filler", "perplexity", "prose", "cached", "multikey", "orders"])
    try:
        return _main(p, args)
    except KeyboardInterrupt:
        print(f"interrupted: every record written to {args.out} is kept; run the same command to resume",
              file=sys.stderr)
        return 130


def _main(p, args):
    for name in ("per_depth", "chunk", "windows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.lengths and any(n < 64 for n in args.lengths):
        p.error("--lengths must be at least 64 tokens each")
    if args.lengths and len(set(args.lengths)) < len(args.lengths):
        p.error(f"--lengths lists a length twice: {args.lengths}")
    if why := out_problem(args.out):
        p.error(why)
    if args.add_formats:
        from kvlab.formats import get_format

        try:
            args.add_formats = [get_format(n).name for n in args.add_formats]
        except ValueError as e:
            p.error(f"--add-formats: {e}")
        if len(set(args.add_formats)) < len(args.add_formats):
            p.error(f"--add-formats lists a format twice: {args.add_formats}")
        if args.out.is_dir():
            p.error(f"--add-formats adds to a sweep file: {args.out} is a folder")
        if not args.out.is_file() or not args.out.stat().st_size:
            p.error(f"--add-formats adds to a sweep: {args.out} holds none yet (run the sweep first)")
    haystack_text = None
    if args.haystack_file is not None:
        try:
            haystack_text = read_text(args.haystack_file, "--haystack-file")
        except ValueError as e:
            p.error(str(e))

    if why := model_problem(args.model):  # before torch loads
        p.error(why)
    from kvlab import tasks
    from kvlab.models import load_model

    lengths = args.lengths or ([] if args.add_formats else [256, 1024] if args.quick else LENGTHS)
    depths = [0.0, 1.0] if args.quick else DEPTHS
    per_depth = 1 if args.quick else args.per_depth
    try:
        model, tok = load_model(args.model)
    except (ValueError, OSError) as e:  # an unknown name or a folder without a model: one line
        p.error(f"--model: {e}")
    fmts = formats(args.quick, "sliding_attention" in (getattr(model.config, "layer_types", None) or []))
    window = getattr(model.config, "max_position_embeddings", None)
    if window and max(lengths, default=0) > window:
        p.error(f"--lengths: {max(lengths)} tokens is past {args.model}'s {window}-token window")
    text = haystack_text or tasks.corpus_text("all")
    hay = tasks.prose_tokens(tok, text)
    if len(hay) < max(lengths, default=0):
        p.error(f"the haystack text has {len(hay)} tokens, fewer than {max(lengths)}")

    header = {"kind": "header", "model": args.model, "depths": depths, "per_depth": per_depth,
              "formats": {f.name: _format_entry(f, model.config.head_dim) for f in fmts},
              "haystacks": {"filler": "repeated filler sentences (kvlab.tasks.FILLER)",
                            "prose": str(args.haystack_file) if args.haystack_file else tasks.CORPUS_SOURCE},
              "chunk": args.chunk, "task": "passkey (5 digits, greedy exact match)"}
    if args.add_formats:
        add_formats(args, p, model, tok, hay, header, args.add_formats)
        print(f"wrote {args.out}")
        return
    done = set()
    if args.out.exists() and args.out.stat().st_size:
        lines, cut = _resume_lines(args.out, p)
        old = lines[0]
        same = {n: _definition(v) for n, v in header["formats"].items()} == \
            {n: _definition(v) for n, v in old.get("formats", {}).items()}
        if not same or any(old.get(k) != header[k] for k in ("model", "depths", "per_depth", "haystacks")):
            p.error(f"{args.out} holds a different sweep (model, depths, formats or haystack); move it away first")
        if cut:
            _drop_cut_line(args.out)  # an interrupted run's last line: its prompt runs again
        done = {(r["stage"], r["length"], r["depth"], r["index"]) for r in lines[1:] if "stage" in r}
        print(f"resuming: {len(done)} prompts already measured", flush=True)
    # every stage's prompt must fit its shortest length: say so now, not after the header and hours of work
    for stage, n in plan_of(args, lengths):
        try:
            prompt_maker(stage, hay)(tok, n, 0.5, random.Random(0))
        except ValueError as e:
            p.error(f"--lengths: the {stage} stage cannot use {n} tokens: {e}")
    with args.out.open("a") as f:
        if not done and args.out.stat().st_size == 0:
            _append(f, header | _provenance())
        plan = plan_of(args, lengths)
        # "cached" prefills once per format: only CACHED there (fp32 reads the same prompts in "filler")
        per_stage = {"filler": fmts, "prose": fmts, "multikey": fmts, "orders": fmts,
                     "cached": fmts[1:] if args.quick else [f for f in fmts if f.name in CACHED]}
        if "perplexity" in args.stages:  # every format on identical held-out windows, each token reading the cache
            for i, x in enumerate(_windows(tok, args.quick, 2 if args.quick else args.windows)):
                if ("perplexity", x.shape[1], 0.0, i) in done:
                    continue
                t0 = time.time()
                _append(f, _window_record(model, x, i, fmts) | {"seconds": round(time.time() - t0, 1)})
                print(f"perplexity window #{i}: {time.time() - t0:.1f}s", flush=True)
        for stage, n in plan:
            make = prompt_maker(stage, hay)
            for d in depths:
                todo = [i for i in range(per_depth) if (stage, n, float(d), i) not in done]
                if not todo:
                    continue
                exs = tasks.sweep_prompts(make, tok, n, d, per_depth, seed=SEEDS[stage])
                for i in todo:
                    t0 = time.time()
                    rec = _needle_head(stage, n, d, i) | _answer(model, exs[i], per_stage[stage], stage, args.chunk)
                    rec["seconds"] = round(time.time() - t0, 1)
                    if stage == "multikey":
                        rec["keys"] = tasks.MULTIKEY_KEYS
                    if stage == "orders":
                        rec["records"] = tasks.ORDER_RECORDS
                    _append(f, rec)
                    correct = rec["correct"]
                    ok = sum(correct.values())
                    print(f"{stage} {n} d={d} #{i}: {ok}/{len(correct)} formats right, {rec['seconds']}s", flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
