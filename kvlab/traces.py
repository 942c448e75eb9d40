"""Load recorded serving traces (Mooncake's format) as :class:`~kvlab.simulator.Request` lists."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .simulator import Request

MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's published traces
MAX_TOKENS = 1 << 20  # a request longer than this (prompt or output) is refused: no model here serves it
MAX_LINE = 1 << 22  # characters in one trace line (4 MiB: 500k hash ids); longer is not a trace


def _no_constants(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def load_trace(path: str | Path, block_size: int = MOONCAKE_BLOCK, limit: int | None = None) -> list[Request]:
    """Load a Mooncake-format trace: one JSON object a line with ``timestamp`` (ms),
    ``input_length``, ``output_length`` and ``hash_ids`` (one id per ``block_size``-token
    block, 512 in Mooncake's traces; equal ids mean equal prefixes). The requests remember
    their block size, and :func:`kvlab.simulator.simulate` refuses another one.

    Bad input raises ValueError naming the file and line: invalid JSON (``NaN`` and
    ``Infinity`` included), missing or mistyped fields, non-finite or negative timestamps,
    fewer hash ids than the prompt has full blocks, an empty trace, a file that is not text.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    if not str(path).strip():
        raise ValueError("trace path is empty")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"trace {path} is a directory, not a JSONL file")
    if path.exists() and not path.is_file():
        raise ValueError(f"trace {path} is not a regular file (a device or a pipe has no end to read to)")
    reqs = []
    try:
        f = open(path, encoding="utf-8-sig")  # a byte-order mark (Windows editors) is read past
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e.strerror or e}") from None
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), ""), 1):
                if len(line) > MAX_LINE:
                    raise ValueError(f"{path}:{lineno}: a line over {MAX_LINE} characters is not a trace line")
                if not line.strip():
                    continue
                reqs.append(_parse_line(line, path, lineno, block_size))
                if limit and len(reqs) >= limit:
                    break
        except UnicodeDecodeError:
            raise ValueError(f"{path}:{lineno + 1}: not UTF-8 text (is this a JSONL trace?)") from None
    if not reqs:
        raise ValueError(f"trace {path} holds no requests")
    return reqs


def _parse_line(line: str, path: Path, lineno: int, block_size: int) -> Request:
    try:
        d = json.loads(line, parse_constant=_no_constants)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{path}:{lineno}: JSON nested too deeply to be a trace line") from None
    except ValueError as e:
        raise ValueError(f"{path}:{lineno}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object")
    for key, typ in (("timestamp", (int, float)), ("input_length", int), ("output_length", int),
                     ("hash_ids", list)):
        if key not in d:
            raise ValueError(f"{path}:{lineno}: missing field {key!r}")
        if not isinstance(d[key], typ) or isinstance(d[key], bool):
            raise ValueError(f"{path}:{lineno}: field {key!r} has the wrong type")
    try:
        ts_ok = math.isfinite(float(d["timestamp"])) and d["timestamp"] >= 0
    except OverflowError:  # an integer too large for a float
        ts_ok = False
    if not ts_ok:
        raise ValueError(f"{path}:{lineno}: timestamp must be a finite number of ms >= 0, got {d['timestamp']!r}")
    if d["input_length"] < 1 or d["output_length"] < 1:
        raise ValueError(f"{path}:{lineno}: input_length and output_length must be >= 1")
    if max(d["input_length"], d["output_length"]) > MAX_TOKENS:
        raise ValueError(f"{path}:{lineno}: input_length and output_length must be at most {MAX_TOKENS} tokens, got "
                         f"{d['input_length']} and {d['output_length']}")
    if not all(isinstance(h, int) and not isinstance(h, bool) for h in d["hash_ids"]):
        raise ValueError(f"{path}:{lineno}: hash_ids must be integers")
    full = d["input_length"] // block_size
    if len(d["hash_ids"]) < full:
        raise ValueError(f"{path}:{lineno}: {len(d['hash_ids'])} hash_ids for {d['input_length']} tokens, fewer "
                         f"than its {full} full blocks of {block_size}: is block_size right? (Mooncake: 512)")
    if len(d["hash_ids"]) > -(-d["input_length"] // block_size):  # one id a block, the last partial one included
        raise ValueError(f"{path}:{lineno}: {len(d['hash_ids'])} hash_ids for {d['input_length']} tokens, more than "
                         f"its {-(-d['input_length'] // block_size)} blocks of {block_size}: is block_size right?")
    return Request(d["timestamp"] / 1000.0, d["input_length"], d["output_length"],
                   [hash(("trace", h)) for h in d["hash_ids"][:full]], None, lineno, block_size)
