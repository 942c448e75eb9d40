"""The ``kvlab`` command line (also ``python -m kvlab``).

    kvlab budget --model llama-3.1-70b --batch 100 --context 32768 --kv-dtype fp8 --gpu H200 --weights-dtype fp8
    kvlab budget --model path/to/config.json --batch 1 --context 8192 --kv-dtype int4 --json
    kvlab formats            # the KV formats kvlab knows, with their bits per element
    kvlab formats --engines  # the flag or API that selects each preset in each serving engine
    kvlab niah --kv-format int4 --lengths 512,2048 --depths 0,0.5,1 --trials 5 --json
    kvlab niah --endpoint http://gpu-a:8000 --compare http://gpu-b:8000 --tokenizer HuggingFaceTB/SmolLM2-135M-Instruct
    kvlab serve --kv-format int4 --port 8001   # an OpenAI-compatible server for the workbook's model
    kvlab serve-sim --workload rag --model llama-3.1-8b --gpu L4 --kv-dtype fp8 --json

Bad input exits with status 2 and one line that names the argument.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

from . import budget as B
from .formats import format_names, get_format
from .paths import WriteError, out_problem, read_text, shown_path

MAX_WORDS = 1_000  # a command line's words: every kvlab command needs a few dozen at most


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump, no value echoed at full length), named by the
    program: the kvlab CLI's and the scripts' (``--help`` still shows the usage). A flag is spelled in full:
    argparse would take ``--len`` for ``--lengths``, and a prefix that a later flag shares changes meaning."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        global _PARSING
        argv = sys.argv[1:] if args is None else list(args)
        if len(argv) > MAX_WORDS:  # argparse's time grows with the square of the words: refuse before it starts
            self.error(f"{len(argv):,} words on the command line; at most {MAX_WORDS:,} are read (is a flag repeated?)")
        _PARSING = (argv, set(self._option_string_actions))  # a subcommand's parser reads them too (error())
        return super().parse_args(argv, namespace)

    def _unknown_flags(self) -> list[str]:
        """The words of the command line being parsed that look like flags and that neither this parser nor the
        top-level one knows (a subcommand's parser is handed only its share of the line, so it reads the whole)."""
        words, top = _PARSING
        words = words[:words.index("--")] if "--" in words else words
        known = set(self._option_string_actions) | top
        return [w for w in words if w.startswith("-") and len(w) > 1 and not _looks_numeric(w)
                and w.split("=")[0] not in known]

    @staticmethod
    def _dash_value_follows(message: str) -> bool:
        """Whether the flag argparse names in ``message`` ("argument --batch: expected ...") is followed on the
        command line by a word starting with '-' (a value taken for an option), not by nothing."""
        m = re.match(r"argument ([^:]+):", message)
        names = set(m.group(1).split("/")) if m else set()
        words = _PARSING[0]
        return any(w in names and i + 1 < len(words) and words[i + 1].startswith("-") for i, w in enumerate(words))

    def error(self, message):
        # argparse names a missing required flag before an unknown one: "--bogus" alone would be answered with
        # "one of --quanto --hqq ... is required". A mistyped flag is the likelier cause; name it instead.
        if message.startswith(("the following arguments are required", "one of the arguments")) \
                and (unknown := self._unknown_flags()):
            message = f"unrecognized arguments: {' '.join(unknown)}"
        if re.search(r"expected (one|at least one) argument", message) and self._dash_value_follows(message):
            message += " (a value that starts with '-' goes as --flag=VALUE)"  # "--batch -inf": taken for an option
        prog = self.prog.removeprefix("python -m ").split()[0]  # a subcommand's errors are the program's
        self.exit(2, f"{prog}: error: {one_line(message)}\n")


def one_line(message: str) -> str:
    """An error message as one line: what would act on a terminal or break the line escaped (argparse and many
    errors quote a value as typed), a run of 200 characters without a space cut, the whole cut at
    :data:`MAX_ERROR_CHARS`."""
    message = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(message))
    message = re.sub(r"\S{200,}", lambda m: _shown(m.group(0), 60), message)
    return _shown(message, MAX_ERROR_CHARS)


def model_problem(name) -> str | None:
    """Why ``name`` cannot be loaded as a model ("--model: could not load ..."), or None: checked without torch
    (:func:`kvlab.models.source`), so a name that names nothing is refused in a fraction of a second."""
    from .models import source

    try:
        source(name)
    except (ValueError, OSError) as e:
        return f"--model: {one_line(e)}"
    return None


_PARSING: tuple[list[str], set[str]] = ([], set())  # the command line Parser.parse_args is reading, its top-level flags


def _looks_numeric(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


MAX_ERROR_CHARS = 400  # an error line is cut here (a long value made of words is one line, not thousands of characters)
MAX_LENGTH = 1 << 20  # tokens in one prompt: past every model here (a larger one would only exhaust memory)
MAX_REQUESTS = 100_000  # serve-sim replays this many at most: 1-2 minutes on a 2-core laptop (serving_replay.json:
# about 2,000 requests/s generated and 2,300-3,500/s replayed); a million took over 10 minutes


MAX_NUMBER_CHARS = 40  # a number flag longer than this is refused before it is parsed


def _number_text(text, what: str) -> str:
    """``text`` stripped, refused when int() or float() would read it in a surprising way: digits from another
    script ("４" is 4 to Python) or thousands of characters (a 5,000-digit integer; "9" * 400 as a float is inf).
    The messages leave out the flag's name: argparse puts "argument --flag:" in front of them."""
    s = text.strip()
    if not text.isascii():  # the text itself: strip() would take a no-break space away unseen
        raise argparse.ArgumentTypeError(f"must be {what} written in ASCII digits, got {_shown(repr(text))}")
    if "_" in s:  # int("1_000") is 1000: a typo as likely as a separator
        raise argparse.ArgumentTypeError(f"must be {what} without '_' separators, got {_shown(repr(text))}")
    if len(s) > MAX_NUMBER_CHARS:
        raise argparse.ArgumentTypeError(f"must be {what} of at most {MAX_NUMBER_CHARS} characters, got "
                                         f"{len(s):,}, starting {s[:20]!r}")
    return s


def _read_number(text, what: str, conv=float):
    """``text`` checked by :func:`_number_text`, and its value by ``conv`` (int or float): ``(stripped text, value)``,
    or the one-line refusal every number flag gives."""
    s = _number_text(text, what)
    try:
        return s, conv(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {_shown(repr(text))}") from None


def int_flag(minimum, maximum=None):
    """An argparse type: an integer in [minimum, maximum] (the messages leave the flag to argparse). The data
    scripts use it too, so their flags refuse what the CLI's refuse ("４", "1_000", 5,000 digits)."""

    def parse(text):
        _, v = _read_number(text, "an integer", int)
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        if maximum is not None and v > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {v}")
        return v

    return parse


def float_flag(minimum: float, maximum: float):
    """An argparse type: a finite number in [minimum, maximum], refused as :func:`int_flag` refuses."""

    def parse(text):
        s, v = _read_number(text, "a number", float)
        if not minimum <= v <= maximum:
            raise argparse.ArgumentTypeError(f"must be from {minimum:g} to {maximum:g}, got {s}{_rounds_to_zero(s, v)}")
        return v + 0.0  # -0 is 0

    return parse


def path_flag(text) -> Path:
    """An argparse type: a path, not empty (``Path("")`` would quietly be the working folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a path")
    return Path(text)


def _rounds_to_zero(s: str, v: float) -> str:
    """' (it rounds to 0)' when ``s`` names a nonzero number that float() reads as 0 (1e-400), else ''."""
    nonzero = any(c in "123456789" for c in s.lower().split("e")[0])
    return " (it rounds to 0)" if v == 0 and nonzero and not s.startswith("-") else ""


def _fraction(text):
    s, v = _read_number(text, "a number", float)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}{_rounds_to_zero(s, v)}")
    return v


def _gib_flag(text):
    s, v = _read_number(text, "a number of GiB", float)
    if not (math.isfinite(v) and 0 <= v <= 1e6) or _rounds_to_zero(s, v):
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB from 0 to 1e6, got {s}{_rounds_to_zero(s, v)}")
    return v + 0.0  # -0 is 0 (it printed as "-0")


def _haystack_text(args) -> str | None:
    """The ``--haystack-file`` text (None without one), read and checked once for both kinds of niah run; a line on
    stderr when it already holds numbers shaped like the key."""
    if args.haystack_file is None:
        return None
    if args.task != "passkey":
        raise ValueError("--haystack-file is for the passkey task")
    text = read_text(args.haystack_file, "--haystack-file")
    _warn_lookalikes(text)
    return text


def _warn_lookalikes(text: str) -> None:
    """A line on stderr when a haystack file already holds numbers shaped like the pass key."""
    from .tasks import key_lookalikes

    if n := key_lookalikes(text):
        print(f"kvlab: warning: --haystack-file holds {n:,} five-digit numbers; a model may answer one of them instead "
              "of the key, which counts as a miss for every format alike (remove them for a cleaner test)", file=sys.stderr)


def model_flag(text):
    """A model name or path: not empty (an empty one would mean the default only by accident)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a model name or path")
    return text


def _kv_format(text):
    try:
        return get_format(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return str(n)


# the library's argument names in an error, as the budget command's flags (the reader typed the flag)
_FLAG_OF = (("kv_format ", "--kv-dtype "), ("tp=", "--tp "), ("unknown GPU ", "--gpu: unknown GPU "))


def _as_flag(message: str) -> str:
    for arg, flag in _FLAG_OF:
        if message.startswith(arg):
            return flag + message[len(arg):]
    return message


def cmd_budget(args) -> int:
    if args.gpu is None:  # these only size the GPU's share: without --gpu they would be silently ignored
        for flag, value in (("--memory-utilization", args.memory_utilization), ("--weights-dtype", args.weights_dtype),
                            ("--reserve-gib", args.reserve_gib), ("--weights-gib", args.weights_gib)):
            if value is not None:  # given at all, even at its default value
                print(f"kvlab: error: {flag} needs --gpu (it sizes what is left for the cache on one)", file=sys.stderr)
                return 2
    elif not args.gpu.strip():
        print("kvlab: error: --gpu is empty", file=sys.stderr)
        return 2
    args.memory_utilization = 0.9 if args.memory_utilization is None else args.memory_utilization
    args.weights_dtype = "bf16" if args.weights_dtype is None else args.weights_dtype
    try:
        if args.gpu:
            B.get_gpu(args.gpu)  # before the model's config: a folder config may take seconds to read
        b = B.budget(args.model, args.batch, args.context, args.kv_dtype, tp=args.tp, block_size=args.block_size)
        out = {
            "model": b.model, "kv_dtype": b.kv_format, "batch": b.batch, "context": b.context,
            "tp": b.tp, "block_size": b.block_size,
            "bytes_per_token": b.bytes_per_token, "cache_bytes": b.cache_bytes,
            "cache_bytes_per_gpu": b.cache_bytes_per_gpu,
            "bits_per_element": get_format(b.kv_format).bits_per_element(
                max(layer.head_dim or layer.latent_dim for layer in B.load_shape(args.model).layers)
            ),
        }
        if args.gpu:
            reserve, source = B.default_reserve(args.tp)
            if args.reserve_gib is not None:
                reserve, source = args.reserve_gib, "--reserve-gib"
            f = B.fit(args.model, args.gpu, args.weights_dtype, tp=args.tp, memory_utilization=args.memory_utilization,
                      reserve_gib=reserve, weights_gib=args.weights_gib)
            kw = dict(tp=args.tp, memory_utilization=args.memory_utilization, block_size=args.block_size,
                      reserve_gib=reserve, weights_gib=args.weights_gib)
            paged = B.blocks(args.model, b.kv_format, max(0, f.free_for_cache_per_gpu), args.context, tp=args.tp,
                             block_size=args.block_size)
            out.update(
                gpu=f.gpu, weights_dtype=args.weights_dtype, weights_bytes_per_gpu=f.weights_bytes_per_gpu,
                usable_bytes_per_gpu=f.usable_bytes_per_gpu, reserve_gib=reserve, reserve_from=source,
                free_bytes_per_gpu=max(0, f.free_for_cache_per_gpu),
                blocks_per_gpu=paged["blocks"], tokens_in_blocks=paged["tokens"],
                fits=f.weights_fit and b.cache_bytes_per_gpu <= f.free_for_cache_per_gpu,
                max_concurrency=paged["max_concurrency"],
                max_context=B.max_context(args.model, args.batch, b.kv_format, f.gpu, args.weights_dtype, **kw),
            )
            # the roofline's predictions (kvlab.decide.latency; no GPU measured them), where the batch fits
            if out["fits"] and B.load_shape(args.model).num_parameters:
                from .decide import latency

                lat = latency(args.model, args.context, b.kv_format, f.gpu, args.weights_dtype, batch=args.batch,
                              tp=args.tp, weights_gib=args.weights_gib)
                out.update(predicted_ttft_ms=round(lat["ttft_s"] * 1e3, 1), predicted_tpot_ms=round(lat["tpot_s"] * 1e3, 2))
            if f.free_for_cache_per_gpu < 0:  # say how far weights + reserve overflow, never a negative free size
                out["reserve_bytes_per_gpu"] = f.reserve_bytes_per_gpu
                out["weights_and_reserve_over_by_bytes"] = -f.free_for_cache_per_gpu
    except (ValueError, TypeError) as e:
        print(f"kvlab: error: {_as_flag(one_line(e))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1, allow_nan=False))
        return 0
    width = max(map(len, out))
    for k, v in out.items():
        shown = _human(v) if "bytes" in k and k != "bytes_per_token" else v
        if k == "bytes_per_token":
            shown = f"{v:,} B"
        if isinstance(v, float):
            shown = f"{v:.4g}"
        print(f"{k:<{width}}  {shown}")
    return 0


def cmd_formats(args) -> int:
    if args.engines:
        from .formats import engine_table

        t = engine_table()
        if args.json:
            print(json.dumps(t, indent=1, allow_nan=False))
            return 0
        names = {k: e["name"] for k, e in t["engines"].items()}
        for preset, opts in t["presets"].items():
            print(preset)
            for k, v in opts.items():
                print(f"  {names[k]:<13} {v or 'not available (no documented option stores exactly this)'}")
            if preset in t.get("conditions", {}):
                print(f"  needs: {t['conditions'][preset]}")
            if preset in t["notes"]:
                print(f"  note: {t['notes'][preset]}")
        for fmt, opts in t.get("nearest", {}).items():  # engine formats close to a kvlab one, not exactly it
            print(f"{fmt} (no preset; the nearest engine options)")
            for k, v in opts.items():
                if v:
                    print(f"  {names[k]:<13} {v}")
        print("\nsources:")
        for e in t["engines"].values():
            print(f"  {e['name']}: {e['source']}")
        return 0
    rows = []
    for name in format_names():
        f = get_format(name)
        rows.append({"name": name, "bits_per_element@head_dim=128": round(f.bits_per_element(128), 4),
                     "residual": f.residual, "source": f.source})
    if args.json:
        print(json.dumps(rows, indent=1, allow_nan=False))
    else:
        for r in rows:
            print(f"{r['name']:<16} {r['bits_per_element@head_dim=128']:>7.3f} bits  {r['source']}")
    return 0


def length_list_flag(text):
    """An argparse type: distinct context lengths, comma-separated."""
    try:
        vals = [int(_number_text(x, "an integer")) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {_shown(repr(text))}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers, got {_shown(repr(text))}")
    if max(vals) > MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_LENGTH:,} tokens, got {max(vals):,}")
    if len(set(vals)) < len(vals):
        raise argparse.ArgumentTypeError(f"lists a value twice: {_shown(repr(text))}")
    return vals



def _depth_list(text):
    try:
        vals = [float(_number_text(x, "a number")) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {_shown(repr(text))}") from None
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {_shown(repr(text))}")
    if len(set(vals)) < len(vals):
        raise argparse.ArgumentTypeError(f"lists a value twice: {_shown(repr(text))}")
    return [v + 0.0 for v in vals]  # -0 is 0


# niah's flags that only a run against servers reads, and their defaults (set to anything else without
# --endpoint, they would be silently ignored)
_ENDPOINT_ONLY = {"compare": None, "tokenizer": None, "endpoint_model": None, "concurrency": 4, "timeout": 120.0,
                  "retries": 3, "backoff": 0.5, "max_tokens": 12, "top_logprobs": 5, "ppl_windows": 0}


ENDPOINT_OUT = "kvlab-endpoints.json"  # kvlab niah --endpoint's result without --out


def _same_file(a, b) -> bool:
    """Whether two paths name one file (through links too); False when either cannot be resolved."""
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


def cmd_niah(args) -> int:
    if args.out is not None and (why := out_problem(args.out)):
        print(f"kvlab: error: {one_line(why)}", file=sys.stderr)
        return 2
    if args.haystack_file is not None and args.haystack != "filler":
        print("kvlab: error: give --haystack or --haystack-file, not both (the file is the haystack)", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else (ENDPOINT_OUT if args.endpoint is not None else None)
    if out is not None and args.haystack_file is not None and any(
            _same_file(p, args.haystack_file) for p in (out, Path(out).with_suffix(".requests.jsonl"))):
        print(f"kvlab: error: --out {shown_path(out)} would overwrite --haystack-file (or its journal would): "
              "give the result another name", file=sys.stderr)
        return 2
    if args.endpoint is not None:
        return cmd_niah_endpoint(args)
    for key, default in _ENDPOINT_ONLY.items():
        if getattr(args, key) != default:
            flag = "--" + key.replace("_", "-")
            print(f"kvlab: error: {flag} is for a run against a server: it needs --endpoint URL", file=sys.stderr)
            return 2
    if why := _task_problem(args):
        print(f"kvlab: error: {one_line(why)}", file=sys.stderr)
        return 2
    if args.kv_format is None:
        print("kvlab: error: --kv-format is required (or --endpoint URL to test a running server)", file=sys.stderr)
        return 2
    try:
        text = _haystack_text(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvlab: error: {one_line(e)}", file=sys.stderr)
        return 2
    if why := model_problem(args.model):  # before torch loads
        print(f"kvlab: error: {why}", file=sys.stderr)
        return 2
    from . import evals  # the model stack, after the cheap checks
    from .models import load_model, load_tokenizer

    try:  # every prompt is built with the tokenizer alone first: a length the task cannot use is refused in seconds
        tok = load_tokenizer(args.model)
        evals.check_prompts(tok, args.task, args.lengths, args.depths, hops=args.hops, haystack=args.haystack,
                            haystack_text=text)
        model, tok = load_model(args.model, tokenizer=tok)
        if args.task == "passkey":
            res = evals.passkey_sweep(model, tok, args.kv_format, args.lengths, args.depths, args.trials,
                                      seed=args.seed, progress=not args.json, prefill=args.prefill,
                                      haystack=args.haystack, haystack_text=text, chunk=args.chunk)
        else:
            res = evals.chain_sweep(model, tok, args.kv_format, args.lengths, args.depths,
                                    hops=args.hops, trials=args.trials, seed=args.seed, progress=not args.json,
                                    prefill=args.prefill)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvlab: error: {one_line(e)}", file=sys.stderr)
        return 2
    failed_write = False
    if args.out:
        try:
            res.save(args.out)  # atomic
        except WriteError as e:  # the run is done: keep it on stdout rather than lose it
            print(f"kvlab: error: --out {e}; the result follows on stdout", file=sys.stderr)
            args.json = True
            failed_write = True
    if args.json:
        print(json.dumps({"task": res.task, "model": res.model, "kv_format": res.kv_format,
                          "accuracy": res.accuracy(), "rows": res.rows, "meta": res.meta}, indent=1, allow_nan=False))
    else:
        print(f"{res.task} with {res.kv_format}: exact match {res.accuracy():.1%} over {len(res.rows)} cells")
        for n in res.lengths:
            print(f"  {n:>6} tokens: " + "  ".join(f"d={d:.4g} {res.accuracy(n, d):4.0%}" for d in res.depths))
    return 1 if failed_write else 0


def _task_problem(args) -> str | None:
    """A flag the chosen task would ignore or cannot take (checked before any model loads), or None.
    Sets the task's default ``--depths`` when none were given."""
    if args.task == "chain":
        if args.depths is None:
            args.depths = [1.0]  # a chain's "depth" is the spread of its links over the prompt
        if any(d <= 0 for d in args.depths):
            return f"--depths: a chain's depths are spreads over the prompt and must be > 0, got {args.depths}"
        if args.haystack != "filler" or args.haystack_file is not None:
            return "--haystack and --haystack-file are for the passkey task"
    else:
        if args.depths is None:
            args.depths = [0.0, 0.5, 1.0]
        if args.hops != 2:
            return "--hops is for --task chain"
    return None


def cmd_niah_endpoint(args) -> int:
    """``kvlab niah --endpoint URL [--compare URL2]``: the ladder against running servers."""
    from . import endpoint as E
    from .paths import write_json

    if why := _task_problem(args):
        print(f"kvlab: error: {one_line(why)}", file=sys.stderr)
        return 2
    if args.chunk is not None:
        print("kvlab: error: --chunk is for kvlab's own model; with --endpoint the prompts are the server's to prefill",
              file=sys.stderr)
        return 2
    try:
        text = _haystack_text(args)  # text like your traffic: the passkey's haystack is cut from it
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvlab: error: {one_line(e)}", file=sys.stderr)
        return 2
    if args.tokenizer is not None and not args.tokenizer.strip():
        print("kvlab: error: --tokenizer is empty", file=sys.stderr)
        return 2

    if args.kv_format is not None:
        print("kvlab: error: --kv-format selects kvlab's own cache; with --endpoint the server's flag decides",
              file=sys.stderr)
        return 2
    if args.prefill != "full":
        print("kvlab: error: --prefill is the server's business with --endpoint", file=sys.stderr)
        return 2
    if args.out is not None and not args.out.strip():
        print("kvlab: error: --out is empty", file=sys.stderr)
        return 2
    out = Path(args.out or ENDPOINT_OUT)
    journal = out.with_suffix(".requests.jsonl")
    from .paths import result_path

    if result_path(out).name.endswith(".requests.jsonl"):  # a run's journal (through a link too): not a result
        print(f"kvlab: error: --out {shown_path(args.out)}: a name ending in .requests.jsonl is a run's journal; give the "
              "result's own name (e.g. result.json, whose journal is result.requests.jsonl)", file=sys.stderr)
        return 2
    interrupted = False
    for path, flag in ((out, "--out"), (journal, "--out's journal")):
        if why := out_problem(path, flag):  # before any request: the answers must have somewhere to go
            print(f"kvlab: error: {one_line(why)}", file=sys.stderr)
            return 2
    try:  # the journal's own name must fit the folder's limit, and it must not be the result file itself
        too_long = len(os.fsencode(journal.name)) > os.pathconf(journal.parent, "PC_NAME_MAX")
        same = os.path.realpath(journal) == os.path.realpath(out)
    except OSError as e:
        print(f"kvlab: error: --out {shown_path(args.out)}: its journal {journal}: {(e.strerror or str(e)).lower()}", file=sys.stderr)
        return 2
    if too_long or same:
        print(f"kvlab: error: --out {shown_path(args.out)}: its journal {journal.name} "
              + ("is a name too long for the folder; give a shorter --out" if too_long else
                 "is a link to the result file itself (each would destroy the other); remove the link"),
              file=sys.stderr)
        return 2
    try:
        key = os.environ.get("OPENAI_API_KEY") or None  # a bearer token, as OpenAI's own clients read it
        eps = [E.Endpoint(u, model=args.endpoint_model, timeout=args.timeout, retries=args.retries,
                           backoff=args.backoff, api_key=key)
               for u in [args.endpoint, *([args.compare] if args.compare else [])]]
        if len({e.url for e in eps}) < len(eps):
            raise ValueError("--endpoint and --compare are the same server")
        name = args.tokenizer or args.model
        # after every argument check: the model stack takes seconds to import
        from transformers import AutoTokenizer

        from .models import reachable, resolve

        try:
            reachable(src := resolve(name))
            tok = AutoTokenizer.from_pretrained(src)
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer {name}: could not load it ({str(e).splitlines()[0]})") from None
        t0 = time.perf_counter()
        doc = E.compare(eps, tok, journal, task=args.task, lengths=args.lengths, depths=args.depths,
                        trials=args.trials, seed=args.seed, hops=args.hops, haystack=args.haystack, haystack_text=text,
                        max_tokens=args.max_tokens, top_logprobs=args.top_logprobs, concurrency=args.concurrency,
                        ppl_windows=args.ppl_windows, progress=not args.json)
        for err in doc.get("perplexity_errors", {}).values():
            if err != "interrupted":
                print(f"kvlab: warning: perplexity: {err}", file=sys.stderr)
        interrupted = "interrupted" in doc.get("perplexity_errors", {}).values()
        ppl_failed = sum(err != "interrupted" for err in doc.get("perplexity_errors", {}).values())
    except (ValueError, E.EndpointError) as e:
        print(f"kvlab: error: {one_line(e)}", file=sys.stderr)
        return 2
    except E.Interrupted as e:
        print(f"kvlab: {e}", file=sys.stderr)
        if getattr(e, "forced", False):  # a second Ctrl-C: do not wait for requests still in flight
            sys.stderr.flush()
            os._exit(130)
        return 130
    doc["journal"] = str(journal)
    if args.haystack_file is not None:
        doc["settings"]["haystack_file"] = str(args.haystack_file)
    doc["wall_seconds"] = round(time.perf_counter() - t0, 1)  # this run only (a resumed run reuses answers)
    try:
        write_json(out, doc)
    except WriteError as e:  # the answers are in the journal (a rerun resumes); show the result too
        kept = (f"the answers stay in {shown_path(journal)}" if journal.is_file() else
                f"the journal {shown_path(journal)} is gone too: a rerun asks every request again")
        print(f"kvlab: error: --out {e}; the result follows on stdout ({kept})", file=sys.stderr)
        print(json.dumps(doc, indent=1, allow_nan=False))
        return 1
    failed = sum(len(v) for v in doc["errors"].values())
    if args.json:
        print(json.dumps(doc, indent=1, allow_nan=False))
    else:
        print(E.markdown(doc))
        for d in doc.get("disagreements", []):
            print(f"  differ at {d['length']} tokens, depth {d['depth']:g}, trial {d['trial']}: teacher "
                  f"{'right' if d['teacher_correct'] else 'wrong'} ({d['teacher_text'][:24]!r}), student "
                  f"{'right' if d['student_correct'] else 'wrong'} ({d['student_text'][:24]!r})")
        if failed:
            first = next(e for errs in doc["errors"].values() for e in errs)
            print(f"{failed} requests failed after their retries (see {journal}); run again to retry them. "
                  f"The first: {first['error'][:300]}")
        print(f"wrote {E._printable(str(out))}")
    for url, off in doc["length_check"].items():  # the server counted other tokens than the prompt was built from
        if off is not None and off > E.LENGTH_TOLERANCE:
            print(f"kvlab: warning: {url} counted prompts up to {off} tokens away from their intended length; "
                  "check that --tokenizer is the served model's", file=sys.stderr)
    for url, n in doc.get("length_unchecked", {}).items():  # a server that does not count: say the check did not run
        if n:
            print(f"kvlab: warning: {url} gave no readable usage.prompt_tokens for {n} answer(s) in this result (answers "
                  "resumed from the journal included); their prompt length was not checked against --tokenizer",
                  file=sys.stderr)
    if interrupted:
        print(f"kvlab: interrupted during the perplexity rung; wrote the ladder to {E._printable(str(out))}", file=sys.stderr)
        return 130
    if ppl_failed:  # asked for, and not measured: not a success
        print(f"kvlab: error: the perplexity rung failed on {ppl_failed} server(s) (warnings above); the ladder "
              f"is in {out}", file=sys.stderr)
    return 1 if failed or ppl_failed else 0


def _listen_problem(host: str, port: int) -> str | None:
    """Why the server could not listen at ``host:port`` (checked before the model loads), or None."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {host!r}: not an address this machine can resolve ({getattr(e, 'strerror', None) or e})"
    if family != socket.AF_INET:  # http.server's ThreadingHTTPServer listens on IPv4 only
        return f"--host {host!r}: the server listens on IPv4 only (e.g. 127.0.0.1 or 0.0.0.0)"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself does
        try:
            s.bind(addr)
        except OSError as e:
            return f"--host {host} --port {port}: cannot listen there ({e.strerror or e})"
    return None


def cmd_serve(args) -> int:
    if why := _listen_problem(args.host, args.port):
        print(f"kvlab: error: {one_line(why)}", file=sys.stderr)
        return 2
    if args.name is not None and (not args.name.strip() or not args.name.isprintable()):
        print(f"kvlab: error: --name {args.name!r} is empty or unprintable", file=sys.stderr)
        return 2
    def terminate(*_):  # SIGTERM (docker stop, systemd, Kubernetes) stops as Ctrl-C does: answers kept
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, terminate)  # from here on, also while the model loads
    try:
        return _serve(args, before)
    except KeyboardInterrupt:  # stopped before it served anything (while loading): nothing to keep
        print("kvlab: interrupted before serving", file=sys.stderr)
        return 130
    finally:
        if signal.getsignal(signal.SIGTERM) is terminate:
            signal.signal(signal.SIGTERM, before)


def _serve(args, before) -> int:
    # said before the model loads, so a standard output that cannot be written (a full disk) fails now, not later
    print(f"kvlab: loading {args.model or 'smollm2-135m'} ...", flush=True)
    if why := model_problem(args.model):  # before torch loads
        print(f"kvlab: error: {why}", file=sys.stderr)
        return 2
    from .models import DEFAULT_MODEL, load_model, resolve
    from .server import CompletionServer  # the model stack, after the cheap checks
    try:
        alias = args.model or DEFAULT_MODEL  # a name kvlab knows ("kvlab-tiny") is the id clients send, not its folder's
        name = args.name or (alias.strip() if str(resolve(alias)) != alias else None)
        model, tok = load_model(args.model)
        positions = getattr(model.config, "max_position_embeddings", None)
        if args.max_model_len and positions and args.max_model_len > positions:
            raise ValueError(f"--max-model-len {args.max_model_len} is longer than the model's "
                             f"{positions:,} positions (max_position_embeddings)")
        srv = CompletionServer(model, tok, args.kv_format, name=name, host=args.host, port=args.port,
                               prefill_mode=args.prefill, max_context=args.max_model_len)
    except (ValueError, OSError) as e:
        print(f"kvlab: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"kvlab: serving {srv.name} with a {srv.fmt.name} KV cache (prompt + answer up to {srv.max_context:,} "
          f"tokens) at {srv.url}/v1", flush=True)
    stopping = False
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        stopping = True
        print("kvlab: stopping (a generation in progress is answered 503)", file=sys.stderr, flush=True)
        srv.httpd.socket.close()  # new connections are refused at once, not accepted and left waiting
        try:  # never exit while a handler thread is inside torch: that aborts the process
            while not srv.stop_generating(timeout=30):
                print("kvlab: still waiting for the model to finish its current step (Ctrl-C again to force)",
                      file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # forced: leave without unwinding (an interpreter exit under torch aborts)
            print("kvlab: forced to stop; the request in progress gets no answer", file=sys.stderr, flush=True)
            os._exit(130)
    finally:
        if stopping and getattr(args, "whole_process", False):
            # no step is running now: a second signal while the process winds down exits 130 at once (only in the
            # `kvlab` process itself: a call from Python must leave the caller's signal handlers as they were)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: os._exit(130))
        else:
            signal.signal(signal.SIGTERM, before)
        srv.httpd.server_close()
    if stopping and getattr(args, "whole_process", False):
        # the interpreter's own shutdown puts the default handlers back and takes seconds with torch loaded, so a
        # second signal then would kill the process (exit 143, no message): nothing is left to unwind, leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_serve_sim(args) -> int:
    from . import serving as S

    if args.trace is not None and args.seed != 0:
        print("kvlab: error: --seed draws a synthetic --workload; a --trace is replayed as recorded", file=sys.stderr)
        return 2
    if args.workload == "chat" and args.requests is not None and args.requests % 5:
        print(f"kvlab: error: --requests for the chat workload counts the turns of 5-turn conversations: give a "
              f"multiple of 5, got {args.requests}", file=sys.stderr)
        return 2
    try:
        if args.trace is not None:
            reqs = S.load_trace(args.trace, block_size=args.block_size or 512, limit=args.requests)
            block = args.block_size or 512
        else:
            block = args.block_size or 16
            kw = {"n": args.requests} if args.requests and args.workload != "chat" else {}
            if args.requests and args.workload == "chat":
                kw = {"conversations": args.requests // 5}
            reqs = S.WORKLOADS[args.workload](block_size=block, seed=args.seed, **kw)
        res = S.simulate(reqs, args.model, args.gpu, args.kv_dtype, weights_dtype=args.weights_dtype,
                         block_size=block, memory_utilization=args.memory_utilization)
        price = B.hourly_price(args.gpu, args.gpu_hour_usd)
    except (ValueError, OSError, TypeError) as e:
        print(f"kvlab: error: {one_line(e)}", file=sys.stderr)
        return 2
    out = res.summary() | {"cost_per_million_output_tokens": res.cost_per_million(price), "gpu_hour_usd": price}
    if args.json:
        print(json.dumps(out, indent=1, allow_nan=False))
    else:
        width = max(map(len, out))
        for k, v in out.items():
            print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return 0


def _shown(text, limit: int = 40) -> str:
    """A value as an error line quotes it: a 5,000-digit number is cut, not echoed whole."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _positive_float(text):
    s, v = _read_number(text, "a number", float)
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}{_rounds_to_zero(s, v)}")
    return v


def _price(text):
    """--gpu-hour-usd: a positive number of dollars, at most :data:`kvlab.budget.MAX_HOURLY_USD` (checked here, not
    after a long simulation)."""
    from .budget import MAX_HOURLY_USD, MIN_HOURLY_USD

    v = _positive_float(text)
    if not MIN_HOURLY_USD <= v <= MAX_HOURLY_USD:
        raise argparse.ArgumentTypeError(f"must be from {MIN_HOURLY_USD:g} to {MAX_HOURLY_USD:,.0f} dollars per "
                                         f"GPU-hour, got {_shown(text.strip())}")
    return v


MIN_TIMEOUT_S = 0.001  # a shorter --timeout could never see an answer (5e-324 is > 0 too)


def _seconds(allow_zero: bool):
    """A duration flag (--timeout, --backoff): finite, at most a day (:data:`kvlab.endpoint.MAX_TIMEOUT_S`)."""
    def parse(text):
        s, v = _read_number(text, "a number of seconds", float)
        from .endpoint import MAX_TIMEOUT_S

        if not (0 <= v <= MAX_TIMEOUT_S) or (v == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else '> 0'} and at most "
                                             f"{MAX_TIMEOUT_S:g} seconds (a day), got {s}{_rounds_to_zero(s, v)}")
        if not allow_zero and v < MIN_TIMEOUT_S:
            raise argparse.ArgumentTypeError(f"must be at least {MIN_TIMEOUT_S:g} seconds, got {s}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvlab", description="Measure KV-cache quantization.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    b = sub.add_parser("budget", help="cache bytes for a model, batch, context and KV format",
                       description="Cache bytes for a model, batch, context and KV format. With --gpu it also says "
                                   "the engine's reserve it took (--reserve-gib, and where its default comes from), the "
                                   "paged blocks the rest makes (--block-size tokens each) and the tokens they hold, "
                                   "whether they fit, max_concurrency (sequences of --context tokens that fit in whole "
                                   "blocks), the roofline's predicted time to first token and per output token at "
                                   "--batch (predictions, not measurements) and "
                                   "max_context (the longest context --batch sequences can hold in memory: a memory "
                                   "limit, which can exceed the model's own window).")
    b.add_argument("--model", required=True, type=model_flag, help="preset name ({}) or a config.json path".format(", ".join(B.preset_names())))
    b.add_argument("--batch", required=True, type=int_flag(1, 10**7))
    b.add_argument("--context", required=True, type=int_flag(1, 10**9), help="tokens per sequence")
    b.add_argument("--kv-dtype", default="bf16", type=_kv_format, help="KV format (see `kvlab formats`)")
    b.add_argument("--gpu", help="GPU preset ({})".format(", ".join(B.gpus())))
    b.add_argument("--weights-dtype", default=None, choices=sorted(B.WEIGHT_BITS), help="default bf16 (needs --gpu)")
    b.add_argument("--tp", default=1, type=int_flag(1, 1024), help="tensor-parallel ranks")
    b.add_argument("--block-size", default=B.VLLM_BLOCK_SIZE, type=int_flag(1, 2**20),
                   help="paged-cache block size in tokens (default 16, vLLM's): sequences take whole blocks")
    b.add_argument("--weights-gib", default=None, type=_gib_flag,
                   help="the weights' GiB on each GPU as your engine logged them (default: counted from --weights-dtype, "
                        "with the embedding and LM head in 16-bit below 16 bits, as quantized checkpoints keep them)")
    b.add_argument("--reserve-gib", default=None, type=_gib_flag,
                   help="GiB the engine keeps for itself on each GPU (activation peak, CUDA graphs, NCCL): read it from "
                        "your engine's log; default by --tp as vLLM logged it for Llama-3-8B on H100s "
                        "(3.05 GiB at TP 1, 4.84 at TP 2 and up)")
    b.add_argument("--memory-utilization", default=None, type=_fraction,
                   help="fraction of GPU memory usable (default 0.9; needs --gpu)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=cmd_budget)

    n = sub.add_parser("niah", help="needle-in-a-haystack (or multi-hop) exact match through a KV format")
    n.add_argument("--kv-format", type=_kv_format, help="KV format (see `kvlab formats`); required without --endpoint")
    n.add_argument("--model", default=None, type=model_flag, help="smollm2-135m (default), gemma3-270m (32k window), kvlab-tiny, "
                                                 "a model folder or a hub name")
    n.add_argument("--lengths", type=length_list_flag, default=[512, 1024, 2048], help="e.g. 512,1024")
    n.add_argument("--depths", type=_depth_list, default=None,
                   help="e.g. 0,0.5,1 (default); for --task chain the spread of its links, default 1")
    n.add_argument("--trials", type=int_flag(1, 10_000), default=5, help="prompts per cell")
    n.add_argument("--task", choices=["passkey", "chain"], default="passkey")
    n.add_argument("--hops", type=int_flag(1, 50), default=2, help="links to follow (chain task)")
    n.add_argument("--seed", type=int_flag(0, 2**32 - 1), default=0)
    n.add_argument("--haystack", choices=["filler", "prose"], default="filler",
                   help="repeated filler sentences, or English text (CPython's docstrings; passkey task)")
    n.add_argument("--haystack-file", help="cut the haystack from this UTF-8 text file instead (e.g. text like "
                                           "your own traffic; passkey task)")
    n.add_argument("--chunk", type=int_flag(1, MAX_LENGTH), default=None,
                   help="prefill this many tokens per forward, as engines do (e.g. 1024 for 32k prompts)")
    n.add_argument("--prefill", choices=["full", "cached"], default="full",
                   help="full: the prompt attends in full precision and only the stored cache is quantized "
                        "(as transformers' QuantizedCache does); cached: the prompt's own attention reads the "
                        "quantized cache (as vLLM V1 and llama.cpp do)")
    n.add_argument("--out", help="save the result as JSON to this file (with --endpoint: default "
                                 "kvlab-endpoints.json, and a .requests.jsonl journal beside it that resumes a run)")
    n.add_argument("--json", action="store_true", help="print one JSON object")
    e = n.add_argument_group("against running OpenAI-compatible servers (vLLM, SGLang, llama-server, kvlab serve)")
    e.add_argument("--endpoint", help="the server to test (the teacher with --compare), e.g. http://host:8000")
    e.add_argument("--compare", help="a second server, e.g. the same model with --kv-cache-dtype fp8")
    e.add_argument("--tokenizer", help="a local tokenizer of the served model (default: --model's)")
    e.add_argument("--endpoint-model", help="the served model's id (default: the server's only model)")
    e.add_argument("--concurrency", type=int_flag(1, 256), default=4, help="requests in flight per run")
    e.add_argument("--timeout", type=_seconds(False), default=120.0, help="seconds to wait for one answer")
    e.add_argument("--retries", type=int_flag(0, 20), default=3, help="retries on 429, 5xx and timeouts")
    e.add_argument("--backoff", type=_seconds(True), default=0.5, help="seconds before the first retry (doubles)")
    e.add_argument("--max-tokens", type=int_flag(1, 4096), default=12, help="tokens generated per prompt")
    e.add_argument("--top-logprobs", type=int_flag(0, 20), default=5,
                   help="top-k logprobs asked per step for teacher agreement (0: none)")
    e.add_argument("--ppl-windows", type=int_flag(0, 1000), default=0,
                   help="also the perplexity rung over this many 512-token windows (needs echo logprobs)")
    n.set_defaults(func=cmd_niah)

    v = sub.add_parser("serve", help="an OpenAI-compatible completions server for a model through a kvlab KV format")
    v.add_argument("--kv-format", required=True, type=_kv_format, help="KV format (see `kvlab formats`)")
    v.add_argument("--model", default=None, type=model_flag, help="smollm2-135m (default), kvlab-tiny, a model folder or a hub name")
    v.add_argument("--name", help="the model id it answers to (default: the model's path)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int_flag(0, 65535), default=8000)
    v.add_argument("--prefill", choices=["full", "cached"], default="full",
                   help="full: a fresh prompt attends in full precision and only the stored cache is quantized "
                        "(as transformers' QuantizedCache does); cached: it reads the quantized cache (as vLLM V1 "
                        "and llama.cpp do)")
    v.add_argument("--max-model-len", type=int_flag(1, 2**31), default=None,
                   help="longest prompt + answer it accepts, in tokens (vLLM's flag; default and upper bound: the "
                        "model's max_position_embeddings)")
    v.set_defaults(func=cmd_serve)

    s = sub.add_parser("serve-sim", help="replay a workload or trace through one replica's prefix-cached KV pool")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", choices=["system-prompt", "chat", "rag", "few-shot"])
    src.add_argument("--trace", help="Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids)")
    s.add_argument("--model", default="llama-3.1-8b", type=model_flag, help="preset name or config.json path")
    s.add_argument("--gpu", default="H100-80GB")
    s.add_argument("--kv-dtype", default="bf16", type=_kv_format)
    s.add_argument("--weights-dtype", default="bf16", choices=sorted(B.WEIGHT_BITS))
    s.add_argument("--block-size", type=int_flag(1, 2**20), default=None,
                   help="tokens per block (default 16; 512 for traces)")
    s.add_argument("--requests", type=int_flag(1, MAX_REQUESTS), default=None,
                   help=f"how many requests to replay (at most {MAX_REQUESTS:,})")
    s.add_argument("--memory-utilization", default=0.9, type=_fraction)
    s.add_argument("--gpu-hour-usd", default=None, type=_price,
                   help="price of one GPU-hour in dollars (default: the GPU's listed price, see data/presets/gpus.json)")
    s.add_argument("--seed", type=int_flag(0, 2**32 - 1), default=0)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_serve_sim)

    f = sub.add_parser("formats", help="list KV formats and their bits per element")
    f.add_argument("--json", action="store_true")
    f.add_argument("--engines", action="store_true",
                   help="how to select each preset in vLLM, SGLang, TensorRT-LLM, llama.cpp, LMDeploy, transformers")
    f.set_defaults(func=cmd_formats)
    return p


def main(argv=None) -> int:
    if sys.stdout is None:  # started with standard output closed (`kvlab ... >&-`): nowhere to put a result
        if sys.stderr is not None:
            print("kvlab: error: standard output is closed", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    args.whole_process = argv is None  # the `kvlab` command itself, not a call from Python (tests, notebooks)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, inside the handler below
        return rc
    except KeyboardInterrupt:  # Ctrl-C before any result existed: nothing to keep, no traceback
        print("kvlab: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise
        try:  # standard output is gone: later writes (and the flush at exit) must not raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        if e.errno == errno.EPIPE:  # the reader stopped early (`kvlab formats | head -1`): quiet, as Unix tools are
            return 141
        print(f"kvlab: error: cannot write the output ({e.strerror or e})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
