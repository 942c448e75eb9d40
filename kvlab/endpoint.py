"""The eval ladder against live OpenAI-compatible servers: is my FP8 / INT4 deployment still retrieving?

A real server does the serving (vLLM, SGLang, llama.cpp's ``llama-server``, or ``kvlab serve``);
kvlab does the measuring, with the same prompts as chapter 4's sweep:

* :class:`Endpoint` is a small client for ``/v1/completions``: a timeout per request, retries
  with exponential backoff on 429 and 5xx (and on dropped connections), clear errors for bad
  URLs, unreachable servers, malformed answers and servers without logprobs.
* :func:`run_ladder` sends every (length, depth, trial) prompt to one or more endpoints through
  a bounded thread pool, appending each answer to a JSONL journal as it arrives, so an
  interrupted run resumes where it stopped.
* :func:`side_by_side` puts a teacher (say ``--kv-cache-dtype auto``) and a student (``fp8``)
  side by side: exact match per cell for both, the prompts where they disagree, and agreement
  of the next-token distributions from the top-k logprobs the servers return.
* :func:`perplexity` is the third rung, from the prompt logprobs a server returns with ``echo``.

Prompts are built from token ids with a local ``transformers`` tokenizer of the served model and
sent as text; each answer's ``usage.prompt_tokens`` says how many tokens the server counted, and
the summary reports the largest difference from the intended length.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import statistics
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, as_completed, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .results import EvalResult, counts
from .tasks import sweep_prompts

TOPK_CAVEAT = ("Servers return only the top-k log-probabilities of each step, so the KL is taken over the "
               "teacher's top-k tokens, renormalised; a token missing from the student's top-k gets the "
               "student's smallest returned probability. Mass outside the top-k is ignored, so this "
               "estimates, and usually understates, the full KL. Steps are compared only up to the first "
               "greedy token where the two differ: after it the contexts differ.")


class EndpointError(RuntimeError):
    """A server could not be used: the message says which one and why."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_ladder`: no new request was sent, every answer that arrived was kept."""

    def __init__(self, kept: int, left: int, journal: Path):
        super().__init__(f"interrupted: {kept} answers kept in {journal}, {left} not answered; run the same "
                         "command again to resume")
        self.kept, self.left, self.journal = kept, left, journal


IDENTITY_FIELDS = ("root", "max_model_len", "kv_format", "kv_cache_dtype")
MAX_ANSWER_BYTES = 64 << 20  # decoded: a gzip bomb stops here
MAX_TIMEOUT_S = 86_400.0
LENGTH_TOLERANCE = 2  # tokens a server may count beyond the intended prompt length (BOS, a merge at the seam)
LOGPROB_FLOOR = -9999.0  # what vLLM reports for a zero probability; strict JSON has no -Infinity


def _redacted(url: str) -> str:
    """``url`` for messages: any ``user:password@`` replaced, and cut to 200 characters."""
    import re

    return re.sub(r"(?<=//)[^/]*@", "***@", url.strip())[:200]  # up to the last @ before the path: a password may hold @


def base_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing ``/v1``; raises ``ValueError`` if it is not a URL.
    Messages never repeat credentials: a URL carrying any is refused before anything else is checked."""
    if not isinstance(url, str) or not url.strip():
        got = repr(url) if isinstance(url, str) else type(url).__name__
        raise ValueError(f"endpoint URL must be a non-empty string, got {got}")
    shown = _redacted(url)
    if "@" in url.split("//", 1)[-1].split("/", 1)[0]:  # it would be written into the journal and --out
        raise ValueError(f"endpoint URL {shown!r} must not carry credentials (user:password@); set OPENAI_API_KEY "
                         "to send a bearer token")
    if any(not c.isprintable() or c.isspace() for c in url.strip()):  # urlsplit would drop a tab or newline unseen
        raise ValueError(f"endpoint URL {shown!r} has spaces or control characters")
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise ValueError(f"endpoint URL {shown!r} is not a valid URL ({e})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"endpoint URL {shown!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"endpoint URL {shown!r} has no host")
    if any(not c.isprintable() or c.isspace() for c in parts.netloc):
        raise ValueError(f"endpoint URL {shown!r}: the host has spaces or control characters")
    if parts.query or parts.fragment:
        raise ValueError(f"endpoint URL {shown!r} must not carry a query or fragment")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    out = f"{parts.scheme}://{parts.netloc}{path}"
    try:
        import httpx

        httpx.URL(out)
    except Exception as e:  # noqa: BLE001 - httpx.InvalidURL and its relatives: the URL cannot be requested
        raise ValueError(f"endpoint URL {shown!r} is not a valid URL: {e}") from None
    return out


@dataclass
class Endpoint:
    """One OpenAI-compatible server. ``model`` is the served model's id (asked from ``/v1/models`` if None)."""

    url: str
    model: str | None = None
    timeout: float = 120.0
    retries: int = 3
    backoff: float = 0.5
    api_key: str | None = None

    def __post_init__(self):
        self.url = base_url(self.url)
        for name, positive in (("timeout", True), ("backoff", False)):
            v = getattr(self, name)
            ok = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
            if not ok or v < 0 or (positive and v == 0) or v > MAX_TIMEOUT_S:
                raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'} and at most "
                                 f"{MAX_TIMEOUT_S:g} s, got {v!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {self.retries!r}")
        key = self.api_key
        if key is not None:
            if not isinstance(key, str) or not key.isascii() or not key.isprintable() or len(key) > 4096:
                raise ValueError("api_key (OPENAI_API_KEY) must be printable ASCII, up to 4,096 characters")
            if not key.strip() or key != key.strip() or " " in key:
                raise ValueError("api_key (OPENAI_API_KEY) must not be blank or contain spaces (a bearer token is one word)")
        self._client = None

    @property
    def client(self):
        import httpx

        if getattr(self, "_closed", False):
            raise EndpointError(f"{self.url}: the client was closed (interrupted)")
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.Client(timeout=self.timeout, headers=headers, follow_redirects=False)
        return self._client

    def close(self, final: bool = False) -> None:
        """Close the connections; ``final``: refuse any further request (a retry in flight stops too)."""
        self._closed = getattr(self, "_closed", False) or final
        if self._client is not None:
            self._client.close()
            self._client = None

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        """One JSON request with retries on 429, 5xx, timeouts and dropped connections.

        ``timeout`` bounds the whole answer, not each read: a server that drips its answer a byte at a
        time is cut off like one that never answers.
        """
        import httpx

        url, last = self.url + path, ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
            try:
                r, content = self._bounded(method, url, body)
            except httpx.TimeoutException:
                last = f"no answer within {self.timeout:g} s"
                continue
            except httpx.ConnectError as e:
                if "SSL" in str(e) or "TLS" in str(e):  # a handshake that failed fails again: no retry
                    raise EndpointError(f"{url}: the TLS handshake failed ({e}); if the server speaks plain HTTP, "
                                        "use http:// rather than https://") from None
                last = f"cannot connect ({e}); is the server running at {self.url}?"
                continue
            except httpx.HTTPError as e:  # the connection dropped mid-answer
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code in (429, 500, 502, 503, 504):  # what may pass; 501, 505, ... never will
                last = f"HTTP {r.status_code}: {_server_message(content)}"
                retry_after = r.headers.get("Retry-After", "")
                if re.fullmatch(r"[0-9]{1,4}", retry_after) and attempt < self.retries:
                    time.sleep(min(float(retry_after), 30.0))
                continue
            if r.status_code >= 400:
                raise EndpointError(f"{url} answered HTTP {r.status_code}: {_server_message(content)}")
            if 300 <= r.status_code < 400:
                where = _redacted(r.headers.get("Location", "?"))
                raise EndpointError(f"{url} answered HTTP {r.status_code}, a redirect to {where!r}, not followed: "
                                    "give the server's own address")
            doc = _json_or_none(content)
            if doc is None and (why := _json_problem(content)):
                raise EndpointError(f"{url} answered with {why}: {content[:200]!r}")
            if not isinstance(doc, dict):
                raise EndpointError(f"{url} answered with JSON that is not an object: "
                                    f"{_printable(json.dumps(doc, ensure_ascii=False)[:200])}")
            return doc
        raise EndpointError(f"{url}: gave up after {self.retries + 1} {'try' if self.retries == 0 else 'tries'}; "
                            f"last: {last}")

    def _bounded(self, method: str, url: str, body):
        """One request, status line to last byte, within ``timeout`` seconds and :data:`MAX_ANSWER_BYTES`.

        It runs in a daemon thread: a server that drips its headers (or sends ``100 Continue`` for ever)
        is abandoned at the deadline, and Ctrl-C or the end of the program never waits for it.
        """
        import httpx

        out: list = []
        deadline = time.monotonic() + self.timeout

        def go():
            try:
                with self.client.stream(method, url, json=body) as r:
                    chunks, size = [], 0
                    for chunk in r.iter_bytes():
                        size += len(chunk)
                        if size > MAX_ANSWER_BYTES:
                            raise EndpointError(f"{url} answered more than {MAX_ANSWER_BYTES >> 20} MiB; not an answer")
                        chunks.append(chunk)
                        if time.monotonic() > deadline:
                            raise httpx.ReadTimeout("the answer took longer than the timeout")
                    out.append((r, b"".join(chunks)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                out.append(e)

        t = threading.Thread(target=go, daemon=True, name="kvlab-request")
        t.start()
        t.join(self.timeout + 0.5)
        if not out:
            raise httpx.ReadTimeout("no complete answer within the timeout")
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def models(self) -> list[str]:
        """The model ids the server lists (``GET /v1/models``)."""
        doc = self._request("GET", "/v1/models")
        data = doc.get("data")
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise EndpointError(f"{self.url}/v1/models: expected {{'data': [{{'id': ...}}]}}, got {str(doc)[:200]}")
        if bad := [m["id"] for m in data if _printable(m["id"]) != m["id"] or not m["id"]]:
            raise EndpointError(f"{self.url}/v1/models: model id {_printable(bad[0])[:80]!r} is not printable text "
                                "(empty, control characters or lone surrogates)")
        self._listed = {m["id"]: m for m in data}
        return [m["id"] for m in data]

    @property
    def identity(self) -> dict:
        """What the server says of the model it serves (after :meth:`resolve_model`): its id and, where the
        server reports them, its root, context and KV format. A journal answer is reused only from the same."""
        entry = getattr(self, "_listed", {}).get(self.model, {})
        return {"model": self.model} | {k: entry[k] for k in IDENTITY_FIELDS
                                         if isinstance(entry.get(k), str | int) and not isinstance(entry.get(k), bool)}

    def resolve_model(self) -> str:
        """``model``, or the server's only model; checks that the server lists it."""
        ids = self.models()
        if self.model is None:
            if len(ids) != 1:
                raise EndpointError(f"{self.url} serves {len(ids)} models ({_ids(ids) or 'none'}); name one")
            self.model = ids[0]
        elif self.model not in ids:
            raise EndpointError(f"{self.url} does not serve {self.model!r}; it lists {_ids(ids)}")
        return self.model

    def complete(self, prompt: str | list[int], max_tokens: int = 16, logprobs: int | None = None,
                 echo: bool = False) -> dict:
        """Greedy completion: ``{"text", "tokens", "token_logprobs", "top_logprobs", "prompt_tokens"}``.

        With ``logprobs=k`` the server must return its top-k per step; a server that does not
        (vLLM caps it with ``--max-logprobs``; llama-cpp-python needs ``logits_all``) gets an
        :class:`EndpointError` saying so.
        """
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if logprobs is not None:
            body["logprobs"] = logprobs
        if echo:
            body["echo"] = True
        doc = self._request("POST", "/v1/completions", body)
        try:
            choice = doc["choices"][0]
            text = choice["text"]
            if not isinstance(text, str):
                raise TypeError
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"{self.url}/v1/completions: malformed answer (no choices[0].text): "
                                f"{json.dumps(doc)[:200]}") from None
        named = doc.get("model")  # the name a server answers with can differ from the id asked (an alias, a dated
        if named is not None and not isinstance(named, str):  # version), but not from one answer to the next
            raise EndpointError(f"{self.url}/v1/completions: 'model' in the answer is not a string: {str(named)[:80]}")
        if named is not None:  # another name is another model answering
            first = self.__dict__.setdefault("_answered_as", named)  # (atomic: worker threads share this endpoint)
            if named != first:
                raise EndpointError(f"{self.url}/v1/completions: answered as model {named[:80]!r} where earlier "
                                    f"answers said {first[:80]!r} (a redeploy behind the URL?); this answer is not kept")
        usage = doc.get("usage")
        counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(counted, bool) or not isinstance(counted, int) or not 1 <= counted <= 1 << 30:
            counted = None  # a server that does not count (0 included), or counts in a shape we cannot read
        out = {"text": text, "prompt_tokens": counted, "answered_as": named}
        if logprobs is not None:
            lp = choice.get("logprobs")
            if not isinstance(lp, dict) or not isinstance(lp.get("top_logprobs"), list) or not lp["top_logprobs"]:
                raise EndpointError(f"{self.url} returned no logprobs (asked for logprobs={logprobs}); start the "
                                    "server so that it returns them, or run with --top-logprobs 0")
            where = f"{self.url}/v1/completions"
            tops = [_top_dict(t, where) for t in lp["top_logprobs"]]
            raw_tlps = lp.get("token_logprobs") or []
            if not isinstance(raw_tlps, list):
                raise EndpointError(f"{where}: logprobs.token_logprobs must be a list, got {str(raw_tlps)[:120]}")
            tlps = [None if x is None else _finite_logprob(x, where) for x in raw_tlps]
            toks = lp.get("tokens") or []
            if not isinstance(toks, list) or not all(isinstance(t, str) for t in toks):
                raise EndpointError(f"{where}: logprobs.tokens must be a list of strings, got {str(toks)[:120]}")
            floored = sum(x == LOGPROB_FLOOR for x in tlps if x is not None)
            out |= {"tokens": toks, "token_logprobs": tlps, "top_logprobs": tops, "floored_logprobs": floored}
        return out


def _ids(ids: list[str], most: int = 10) -> str:
    """Model ids for an error line: the first few, cut, and how many in all (a server may list thousands)."""
    shown = ", ".join(str(i)[:80] for i in ids[:most])
    return shown + (f", ... ({len(ids):,} in all)" if len(ids) > most else "")


def _finite_logprob(x, where: str) -> float:
    """A log-probability as a finite float: -inf (a zero probability) becomes :data:`LOGPROB_FLOOR`, as vLLM
    reports it; NaN, a positive value or a non-number is the server's error and says so."""
    if isinstance(x, bool) or not isinstance(x, int | float) or (isinstance(x, float) and math.isnan(x)) or x > 1e-6:
        raise EndpointError(f"{where}: a log-probability must be a number <= 0, got {str(x)[:40]}")
    if x > 0:  # within rounding of zero (a probability of 1): 0, so no positive log-probability is written out
        return 0.0
    return LOGPROB_FLOOR if x < LOGPROB_FLOOR else float(x)  # (an integer of 400 digits never reaches float())


def _top_dict(entry, where: str) -> dict[str, float] | None:
    """One step's top log-probabilities as ``{token: logprob}``: the completions API's dict, or the list of
    ``{"token", "logprob"}`` objects that chat-style servers return."""
    if entry is None:
        return None
    if isinstance(entry, list):
        try:
            entry = {e["token"]: e["logprob"] for e in entry}
        except (TypeError, KeyError):
            raise EndpointError(f"{where}: top_logprobs entries must be {{token: logprob}} or a list of "
                                f"{{'token', 'logprob'}} objects, got {str(entry)[:120]}") from None
    if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
        raise EndpointError(f"{where}: top_logprobs entries must map tokens to log-probabilities, got {str(entry)[:120]}")
    return {k: _finite_logprob(v, where) for k, v in entry.items()}


def _strict_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def _json_or_none(content: bytes):
    """``content`` parsed as JSON (NaN and Infinity allowed: the fields that matter are checked one by one),
    or None if it is not JSON, or nests too deeply to parse."""
    try:  # an integer of thousands of digits is legal JSON that int() refuses: read it as out of range (inf)
        return json.loads(content, parse_int=lambda t: int(t) if len(t) <= 4000 else float("-inf" if t[0] == "-" else "inf"))
    except (ValueError, RecursionError):
        return None


def _printable(text: str) -> str:
    """``text`` safe to print on a terminal and to encode: control characters (escape sequences that could
    clear the screen or fake a line) and lone surrogates are written as Python escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _json_problem(content: bytes) -> str | None:
    """What is wrong with a body :func:`_json_or_none` read as None, in words; None when it is JSON's ``null``."""
    try:
        json.loads(content)
    except RecursionError:
        return "JSON nested too deeply to read"
    except ValueError:
        return "something that is not JSON"
    return None


def _server_message(content: bytes) -> str:
    """A server's error body in one line (printable: see :func:`_printable`): its JSON message, or the text of
    an HTML page without the tags."""
    return _printable(_raw_server_message(content))


def _raw_server_message(content: bytes) -> str:
    doc = _json_or_none(content)
    if doc is None:
        text = content[:4000].decode("utf-8", "replace")
        title = re.search(r"<title>(.*?)</title>", text, re.S | re.I)
        text = title.group(1) if title else re.sub(r"<[^>]*>", " ", text)
        return " ".join(text.split())[:300]
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    msg = err.get("message", err) if isinstance(err, dict) else err
    return str(msg)[:300]


# --------------------------------------------------------------------------- the ladder

@dataclass
class Prompt:
    """One rung's prompt: ``key`` names its cell, ``answer`` is what exact match compares with."""

    task: str
    length: int
    depth: float
    trial: int
    text: str
    answer: str

    @property
    def key(self) -> str:
        """Its cell and trial, and a hash of its text: a journal answer is reused only for the same prompt."""
        digest = hashlib.sha1(self.text.encode()).hexdigest()[:16]
        return f"{self.task}/{self.length}/{self.depth:g}/{self.trial}/{digest}"


def ladder_prompts(tok, task: str = "passkey", lengths=(512, 2048), depths=(0.0, 0.5, 1.0), trials: int = 3,
                   seed: int = 0, hops: int = 2, haystack: str = "filler", haystack_text: str | None = None) -> list[Prompt]:
    """The prompts of chapter 4's sweep (same seeds), as text for a server; ``haystack_text`` cuts the passkey's
    haystack from your own text (text like your traffic) instead of the filler or prose one."""
    from . import tasks
    from .evals import _check_args, _passkey_maker

    _check_args(lengths, depths, trials)
    if haystack_text is not None and task != "passkey":
        raise ValueError("a haystack text is for the passkey task")
    if task == "passkey":
        make = _passkey_maker(tok, lengths, haystack, haystack_text)[0]
    elif task == "chain":
        if any(d <= 0 for d in depths):
            raise ValueError(f"chain depths are spreads and must be > 0, got {list(depths)!r}")

        def make(tok, n, d, rng):
            return tasks.variable_chain(tok, n, d, rng, hops=hops)
    else:
        raise ValueError(f"task must be 'passkey' or 'chain', got {task!r}")
    out = []
    for n in lengths:
        for d in depths:
            for i, ex in enumerate(sweep_prompts(make, tok, n, d, trials, seed)):
                out.append(Prompt(task, n, float(d), i, tok.decode(ex.input_ids), ex.answer.strip()))
    return out


def exact_match(text: str, answer: str) -> bool:
    """The completion starts with ``answer`` (after spaces) and does not run on into more digits or letters."""
    t = text.lstrip()
    return t.startswith(answer) and not (len(t) > len(answer) and t[len(answer)].isalnum())


def _journal(path: Path, settings: dict[str, dict]) -> dict[tuple[str, str], dict]:
    """The answers a journal holds for these endpoints, if they were asked with the same ``settings`` (per URL).

    A line cut short, or one without the fields an answer needs, is skipped (asked again); an answer
    from the same URL asked with other settings (max tokens, top logprobs, or another model or KV format
    behind the URL) is refused, naming the difference, rather than silently reused.
    """
    done = {}
    if path.is_symlink():  # appending through a link writes into whatever file it names
        raise ValueError(f"journal {path} is a symbolic link; a journal is the run's own file: remove the link")
    if not path.exists():
        return done
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        try:
            r = json.loads(line, parse_constant=_strict_constant)
        except (ValueError, RecursionError):
            r = None
        if n == 1 and not (isinstance(r, dict) and "endpoint" in r and "key" in r):  # a journal starts with one
            raise ValueError(f"journal {path}: its first line is not an answer this command wrote; it is another "
                             "file: give another --out, or move that file away")
        if r is None:
            continue  # a line cut short by an interrupted write, or not strict JSON: ask again
        if not isinstance(r, dict) or r.get("error") or not isinstance(r.get("key"), str):
            continue
        url = r.get("endpoint")
        if url not in settings:
            continue
        if r.get("settings") != settings[url]:
            raise ValueError(f"journal {path} line {n}: {url} was asked with {r.get('settings')}, this run asks "
                             f"{settings[url]}; use another --out (or delete the journal) to start afresh")
        if not isinstance(r.get("correct"), bool) or not isinstance(r.get("text"), str) or not (
                r.get("prompt_tokens") is None or isinstance(r.get("prompt_tokens"), int)
                and not isinstance(r.get("prompt_tokens"), bool)):
            continue  # not a complete answer: ask again
        done[url, r["key"]] = r
    return done


def run_ladder(endpoints: list[Endpoint], prompts: list[Prompt], journal: str | Path, *, max_tokens: int = 12,
               top_logprobs: int = 5, concurrency: int = 4, progress: bool = True) -> list[dict]:
    """Every prompt through every endpoint; each answer is appended to ``journal`` (JSONL) as it arrives.

    Answers already in the journal (same endpoint, same prompt text, same settings and server identity)
    are reused, so a run that was interrupted resumes. A request that still fails after its retries is
    recorded with its ``error`` and retried on the next run. At most ``concurrency`` requests are in
    flight: on Ctrl-C no new one is sent, those in flight are waited for and written, and
    :class:`Interrupted` says how many answers were kept (a second Ctrl-C stops waiting).
    Returns one record per (endpoint, prompt).
    """
    from tqdm.auto import tqdm

    if not endpoints:
        raise ValueError("give at least one endpoint")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
        raise ValueError(f"top_logprobs must be an integer in [0, 20], got {top_logprobs!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 4096:
        raise ValueError(f"max_tokens must be an integer in [1, 4096], got {max_tokens!r}")
    journal = Path(journal)
    if journal.exists() and not journal.is_dir() and not journal.is_file():
        raise ValueError(f"journal {str(journal)!r} exists and is not a regular file")
    if journal.is_dir() or not journal.parent.is_dir():
        raise ValueError(f"journal {str(journal)!r}: " + ("is a directory" if journal.is_dir()
                         else f"folder {str(journal.parent)!r} does not exist"))
    for ep in endpoints:  # a bad URL or a dead server fails here, before any prompt is sent
        ep.resolve_model()
    settings = {ep.url: {"max_tokens": max_tokens, "top_logprobs": top_logprobs} | ep.identity for ep in endpoints}
    done = _journal(journal, settings)
    for (url, _), rec in done.items():  # a resumed run holds the server to the model its earlier answers named
        if isinstance(rec.get("answered_as"), str):
            next(ep for ep in endpoints if ep.url == url).__dict__.setdefault("_answered_as", rec["answered_as"])
    for ep in endpoints:  # the key names the prompt, so its cell comes from the prompt, not from the journal line
        for p in prompts:
            if (ep.url, p.key) in done:  # and its correctness from its stored text, not from the journal's flag
                rec = done[ep.url, p.key]
                rec |= {f: getattr(p, f) for f in ("task", "length", "depth", "trial", "answer")}
                rec["correct"] = exact_match(rec["text"], p.answer)
    todo = [(ep, p) for ep in endpoints for p in prompts if (ep.url, p.key) not in done]
    k = top_logprobs or None

    def one(ep: Endpoint, p: Prompt) -> dict:
        rec = {"endpoint": ep.url, "model": ep.model, "key": p.key, "settings": settings[ep.url],
               **{f: getattr(p, f) for f in ("task", "length", "depth", "trial", "answer")}}
        t0 = time.perf_counter()
        try:
            out = ep.complete(p.text, max_tokens=max_tokens, logprobs=k)
            rec |= out | {"correct": exact_match(out["text"], p.answer), "error": None}
        except EndpointError as e:
            rec |= {"error": str(e)}
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        return rec

    kept = 0
    queue = iter(todo)
    pool = ThreadPoolExecutor(max_workers=concurrency)
    cut = journal.exists() and journal.stat().st_size and not journal.read_bytes().endswith(b"\n")
    with journal.open("ab", buffering=0) as fh, tqdm(total=len(todo), disable=not progress, desc="requests") as bar:
        def write(rec):
            nonlocal kept, cut
            try:  # only this thread writes (workers return records); unbuffered, so a failed write is not retried
                data = (b"\n" if cut else b"") + (json.dumps(rec, allow_nan=False) + "\n").encode()
                cut = False  # a line an earlier run left cut short is ended first, so this record stays whole
                while data:
                    data = data[fh.write(data):]
            except OSError as e:  # a full disk: name the journal, and what a rerun does
                raise ValueError(f"journal {journal}: {e.strerror or e}; the {kept} answers written before are kept "
                                 "(a cut-off last line is ignored): free space and run the same command to resume") from None
            kept += 1
            bar.update()
            if not rec["error"]:
                done[rec["endpoint"], rec["key"]] = rec
            else:
                done.setdefault((rec["endpoint"], rec["key"]), rec)

        running = set()
        try:
            for ep, p in itertools.islice(queue, concurrency):  # a bounded window: Ctrl-C stops sending at once
                running.add(pool.submit(one, ep, p))
            while running:
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    write(fut.result())
                    nxt = next(queue, None)
                    if nxt is not None:
                        running.add(pool.submit(one, *nxt))
        except KeyboardInterrupt:
            if running:  # say why nothing happens yet: the answers on their way can take a request's timeout
                bar.clear()
                print(f"kvlab: interrupted; waiting for {len(running)} request(s) in flight to answer (Ctrl-C again "
                      "to stop now; every answer already received is kept)", file=sys.stderr, flush=True)
            try:
                for fut in as_completed(running):  # the answers already on their way are kept
                    write(fut.result())
            except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, and cut the requests in flight
                for ep in endpoints:
                    ep.close(final=True)
                forced = True
            else:
                forced = False
            pool.shutdown(wait=False, cancel_futures=True)
            err = Interrupted(kept, len(todo) - kept, journal)
            err.forced = forced
            raise err from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    return [done[ep.url, p.key] for ep in endpoints for p in prompts if (ep.url, p.key) in done]


# --------------------------------------------------------------------------- side by side

def _topk_kl(teacher: dict[str, float], student: dict[str, float]) -> float:
    """KL(teacher || student) over the teacher's top-k, both renormalised there (see TOPK_CAVEAT)."""
    floor = min(student.values())
    keys = list(teacher)
    t = [teacher[x] for x in keys]
    s = [student.get(x, floor) for x in keys]
    lt, ls = _logsumexp(t), _logsumexp(s)
    return max(0.0, sum(math.exp(a - lt) * ((a - lt) - (b - ls)) for a, b in zip(t, s)))


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def agreement(teacher: dict, student: dict) -> dict | None:
    """Top-k KL, top-1 agreement and the first greedy divergence for one prompt (None without logprobs)."""
    tt, st = teacher.get("top_logprobs"), student.get("top_logprobs")
    if not tt or not st:
        return None
    ta, sa = teacher.get("tokens") or [], student.get("tokens") or []
    n = min(len(ta), len(sa))
    first = next((i for i in range(n) if ta[i] != sa[i]), None)
    upto = (first if first is not None else n - 1) + 1  # same context up to and including the divergence
    kls, top1, floored = [], [], 0
    for i in range(min(upto, len(tt), len(st))):
        if not tt[i] or not st[i]:
            continue
        top1.append(max(tt[i], key=tt[i].get) == max(st[i], key=st[i].get))
        if LOGPROB_FLOOR in tt[i].values() or LOGPROB_FLOOR in st[i].values():
            floored += 1  # a zero probability (-Infinity, reported as the floor) has no finite KL: left out, counted
            continue
        kls.append(_topk_kl(tt[i], st[i]))
    if not top1:
        return None
    return {"kl": sum(kls) / len(kls) if kls else None, "top1": sum(top1) / len(top1), "first_divergence": first,
            "identical": first is None and len(ta) == len(sa), "kl_tokens": len(kls), "floored_tokens": floored}


def _result(records: list[dict], label: str, task: str) -> EvalResult:
    cells: dict[tuple[int, float], list[int]] = {}
    for r in records:
        if not r.get("error"):
            c = cells.setdefault((r["length"], r["depth"]), [0, 0])
            c[0] += bool(r["correct"])
            c[1] += 1
    rows = [{"length": n, "depth": d, "trials": t, "correct": c} for (n, d), (c, t) in sorted(cells.items())]
    # the KV format is what the server says it stores (kvlab serve: kv_format; others: kv_cache_dtype), else unknown
    said = [st.get("kv_format") or st.get("kv_cache_dtype") for r in records if isinstance(st := r.get("settings"), dict)]
    fmt = next((str(x) for x in said if x), "not reported by the server")
    return EvalResult(task, records[0].get("model") or "?" if records else "?", fmt, rows, meta={"endpoint": label})


def side_by_side(records: list[dict], teacher_url: str, student_url: str | None = None) -> dict:
    """Exact match per cell for each endpoint, the prompts where they disagree, and teacher agreement.

    Returns a JSON-ready dict: ``results`` (``EvalResult`` fields per endpoint URL),
    ``errors`` (requests that failed after their retries), ``length_check`` (largest
    difference between a prompt's intended length and the server's ``prompt_tokens``), ``length_unchecked``
    (answers that carried no readable ``usage.prompt_tokens``, so no length check), and
    with a student: ``disagreements`` and ``agreement`` (with its caveat).
    """
    teacher_url = base_url(teacher_url)
    urls = [teacher_url] + ([base_url(student_url)] if student_url else [])
    by = {u: {r["key"]: r for r in records if r["endpoint"] == u} for u in urls}
    task = next((r["task"] for r in records), "passkey")
    doc = {"task": task, "teacher": teacher_url, "student": urls[1] if student_url else None,
           "lengths": sorted({r["length"] for r in records}),  # asked, answered or not
           "results": {u: asdict(_result(list(by[u].values()), u, task)) for u in urls},
           "errors": {u: [{"key": k, "error": r["error"]} for k, r in by[u].items() if r.get("error")] for u in urls},
           "length_check": {u: max((abs(r["prompt_tokens"] - r["length"]) for r in by[u].values()
                                    if _counted(r)), default=None) for u in urls},
           # answers whose usage.prompt_tokens was missing, zero or unreadable: their length was not checked
           "length_unchecked": {u: sum(1 for r in by[u].values() if not r.get("error") and not _counted(r))
                                for u in urls},
           "seconds_per_request": {u: _mean_or_none([r["seconds"] for r in by[u].values() if not r.get("error")
                                                     and isinstance(r.get("seconds"), int | float)]) for u in urls}}
    if student_url:
        t, s = by[teacher_url], by[urls[1]]
        both = [k for k in t if k in s and not t[k].get("error") and not s[k].get("error")]
        doc["disagreements"] = [
            {f: t[k][f] for f in ("length", "depth", "trial", "answer")}
            | {"teacher_correct": t[k]["correct"], "student_correct": s[k]["correct"],
               "teacher_text": t[k]["text"], "student_text": s[k]["text"]}
            for k in both if t[k]["correct"] != s[k]["correct"]]
        doc["paired"] = _paired(doc["disagreements"], [t[k]["length"] for k in both])
        ag = [a for k in both if (a := agreement(t[k], s[k])) is not None]
        doc["agreement"] = None if not ag else {
            "prompts": len(ag), "mean_topk_kl": _mean_or_none([a["kl"] for a in ag if a["kl"] is not None]),
            "floored_tokens": sum(a["floored_tokens"] for a in ag),
            "top1_agreement": sum(a["top1"] for a in ag) / len(ag),
            "identical_greedy": sum(a["identical"] for a in ag),
            "median_first_divergence": _or_none(statistics.median, [a["first_divergence"] for a in ag
                                                                     if a["first_divergence"] is not None]),
            "caveat": TOPK_CAVEAT}
    return doc


def _counted(record: dict) -> bool:
    """Whether an answer carried a prompt-token count the length check can use (a positive integer)."""
    n = record.get("prompt_tokens")
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _paired(disagreements: list[dict], lengths: list[int]) -> dict:
    """The book's rule on a side-by-side: the student against the teacher on the prompts both answered, by exact
    McNemar (:func:`kvlab.results.verdict`), at each length and with every length pooled. ``lengths`` has one entry per
    prompt both answered. ``{"4096": {"prompts", "lost", "gained", "p", "verdict", "detectable_loss"}, ...,
    "pooled": {...}}``; ``detectable_loss`` is the smallest loss (a fraction of prompts) that many prompts call worse
    80% of the time with no chance flips (:func:`kvlab.power.detectable_loss`; ``None``: no loss is detectable)."""
    from .power import detectable_loss
    from .results import mcnemar, verdict

    def row(ds, n):
        lost = sum(d["teacher_correct"] and not d["student_correct"] for d in ds)
        gained = sum(d["student_correct"] and not d["teacher_correct"] for d in ds)
        return {"prompts": n, "lost": lost, "gained": gained, "p": mcnemar(lost, gained), "verdict": verdict(lost, gained),
                "detectable_loss": detectable_loss(n) if n else None}

    out = {str(n): row([d for d in disagreements if d["length"] == n], lengths.count(n)) for n in sorted(set(lengths))}
    if lengths:
        out["pooled"] = row(disagreements, len(lengths))
    return out


def _or_none(f, xs: list):
    return f(xs) if xs else None


def _mean_or_none(xs: list[float]) -> float | None:
    return _or_none(statistics.fmean, xs)


def results(doc: dict) -> dict[str, EvalResult]:
    """The side-by-side JSON's per-endpoint results as :class:`EvalResult` (``.figure()`` draws the heatmap)."""
    return {u: EvalResult(**r) for u, r in doc["results"].items()}


def markdown(doc: dict) -> str:
    """The side-by-side as a Markdown table: exact match per length for each endpoint, and the agreement."""
    res = results(doc)
    urls = list(res)
    lengths = sorted(set(doc.get("lengths") or []) | {n for r in res.values() for n in r.lengths})
    head = "| endpoint | " + " | ".join(f"{n} tokens" for n in lengths) + " |\n|---|" + "---|" * len(lengths)
    if not lengths:
        head = "| endpoint | exact match |\n|---|---|"
    def cell(r: EvalResult, n: int) -> str:
        c, t = counts(r.rows, length=n)
        return f"{c}/{t}" if t else "—"

    rows = [f"| {u} | " + (" | ".join(cell(res[u], n) for n in lengths) if lengths else "no answers") + " |"
            for u in urls]
    out = head + "\n" + "\n".join(rows)
    failed = {u: len(e) for u, e in (doc.get("errors") or {}).items() if e}
    if failed:  # a cell counts answered prompts only ("—": none answered)
        out += "\n\nFailed (after any retries; not counted above): " + ", ".join(
            f"{n} request(s) to {u}" for u, n in failed.items()) + "."
    if doc.get("student"):
        a = doc.get("agreement")
        out += f"\n\n{len(doc['disagreements'])} prompts answered differently."
        if pr := doc.get("paired"):  # the workbook's one rule: exact McNemar on the same prompts
            out += ("\n\nStudent against teacher, paired (−lost +gained, exact McNemar): " + "; ".join(
                f"{'pooled' if n == 'pooled' else n + ' tokens'}: −{r['lost']} +{r['gained']} of {r['prompts']}, "
                f"{r['verdict']} (p = {r['p']:.2g})" for n, r in pr.items()) + ".")
            out += ("\n\nThe smallest loss these prompts detect 80% of the time (no chance flips; `kvlab.power`): " + "; ".join(
                f"{'pooled' if n == 'pooled' else n + ' tokens'}: "
                + (f"{r['detectable_loss']:.0%} of prompts" if r.get("detectable_loss") else "none (too few prompts)")
                for n, r in pr.items()) + ". Run more prompts to rule out smaller losses.")
        if a:
            kl = "n/a (every token had a zero probability)" if a["mean_topk_kl"] is None else f"{a['mean_topk_kl']:.4f} nats"
            out += (f" Over {a['prompts']} prompts: top-k KL {kl}, top-1 agreement "
                    f"{a['top1_agreement']:.0%}, identical greedy text {a['identical_greedy']}.")
            if a.get("floored_tokens"):
                out += (f" {a['floored_tokens']} tokens where a server reported a zero probability (-Infinity) are "
                        "left out of the KL, which is infinite there.")
    return out


def perplexity(ep: Endpoint, tok, text: str | None = None, window: int = 512, max_windows: int = 4) -> float:
    """Perplexity of held-out text from the prompt logprobs the server returns with ``echo`` (``max_tokens=1``).

    What it measures depends on the server's prefill: where the prompt reads its own quantized cache
    (vLLM V1 and llama.cpp, ``kvlab serve --prefill cached``) every scored token sees the KV format;
    ``kvlab serve``'s default lets a fresh prompt attend in full precision, so there a prompt scored in
    one forward pass never reads the quantized cache and this rung cannot see the format (chapter 4.4).
    """
    from .tasks import heldout_windows

    windows = heldout_windows(tok, text, window, max_windows)
    ep.resolve_model()
    nll, count = 0.0, 0
    for w in windows:
        out = ep.complete(tok.decode(w), max_tokens=1, logprobs=1, echo=True)
        lps = [x for x in out["token_logprobs"][: out["prompt_tokens"] or window] if x is not None]
        if not lps:
            raise EndpointError(f"{ep.url} returned no prompt logprobs with echo=true; this rung needs them")
        expected = len(w) - 1  # every token of the window sent but the first has one (whatever usage claims)
        if len(lps) < expected - LENGTH_TOLERANCE:  # a perplexity over a few tokens would pass for the window's
            raise EndpointError(f"{ep.url} returned {len(lps)} prompt log-probabilities for a prompt of "
                                f"{expected + 1} tokens with echo=true; this rung needs one per token")
        nll -= sum(lps)
        count += len(lps)
    if nll / count > 700:  # exp would overflow: the server gave (near-)zero probabilities to the text
        raise EndpointError(f"{ep.url}: perplexity beyond float range (mean NLL {nll / count:.0f} nats a token): "
                            "the server gave the held-out text near-zero probabilities")
    return math.exp(nll / count)


def compare(endpoints: list[Endpoint], tok, journal: str | Path, *, task: str = "passkey", lengths=(512, 2048),
            depths=(1.0,), trials: int = 3, seed: int = 0, hops: int = 2, haystack: str = "filler",
            max_tokens: int = 12, top_logprobs: int = 5, concurrency: int = 4, ppl_windows: int = 0,
            progress: bool = True, haystack_text: str | None = None) -> dict:
    """The ladder against running servers, side by side: what ``kvlab niah --endpoint URL [--compare URL2]`` and
    ``scripts/compare_engines.py`` run. The first endpoint is the teacher. Prompts past a server's
    ``max_model_len`` are refused before any is built; answers go to ``journal`` as they arrive (a rerun resumes).
    With ``ppl_windows``, each server's held-out perplexity is added (``doc["perplexity"]``); a failed or
    interrupted perplexity rung is recorded in ``doc["perplexity_errors"]`` beside the ladder's result, not instead
    of it. Raises :class:`Interrupted` (answers kept in the journal) when the ladder itself is interrupted."""
    for e in endpoints:  # the server says how long a prompt may be: refuse what it would refuse, before building it
        e.resolve_model()
        limit = e.identity.get("max_model_len")
        if isinstance(limit, int) and max(lengths) + max_tokens > limit:
            raise ValueError(f"--lengths {max(lengths)} + --max-tokens {max_tokens} is past {e.url}'s "
                             f"max_model_len of {limit}")
    prompts = ladder_prompts(tok, task, lengths, depths, trials, seed=seed, hops=hops, haystack=haystack,
                             haystack_text=haystack_text)
    if haystack_text is not None:  # the settings say the prompts came from the user's own text, and which
        haystack = "text"
    records = run_ladder(endpoints, prompts, journal, max_tokens=max_tokens, top_logprobs=top_logprobs,
                         concurrency=concurrency, progress=progress)
    doc = side_by_side(records, endpoints[0].url, endpoints[1].url if len(endpoints) > 1 else None)
    doc["settings"] = dict(task=task, lengths=list(lengths), depths=list(depths), trials=trials, seed=seed, hops=hops,
                           haystack=haystack, max_tokens=max_tokens, top_logprobs=top_logprobs, concurrency=concurrency)
    if haystack_text is not None:
        import hashlib

        doc["settings"]["haystack_sha256"] = hashlib.sha256(haystack_text.encode("utf-8", "surrogatepass")).hexdigest()
    if ppl_windows:
        doc["perplexity"], doc["perplexity_errors"] = {}, {}
        for e in endpoints:
            try:
                doc["perplexity"][e.url] = perplexity(e, tok, max_windows=ppl_windows)
            except EndpointError as err:
                doc["perplexity"][e.url] = None
                doc["perplexity_errors"][e.url] = str(err)
            except KeyboardInterrupt:  # the ladder's result is whole: return it, without this rung
                doc["perplexity"][e.url] = None
                doc["perplexity_errors"][e.url] = "interrupted"
                break
    return doc


def load(path: str | Path) -> dict:
    """A side-by-side JSON written by ``kvlab niah --endpoint ... --out``."""
    from .paths import load_json, shown_path

    doc = load_json(path, "side-by-side")
    if missing := sorted({"task", "teacher", "results"} - set(doc)):
        raise ValueError(f"side-by-side {shown_path(path)}: not a kvlab endpoint side-by-side (missing {', '.join(missing)})")
    if not isinstance(doc["results"], dict) or not all(isinstance(r, dict) for r in doc["results"].values()):
        raise ValueError(f"side-by-side {shown_path(path)}: results must map each server to its result")
    for url, r in doc["results"].items():
        try:
            EvalResult(**r)
        except (TypeError, ValueError) as e:
            raise ValueError(f"side-by-side {shown_path(path)}: results[{url!r}]: {e}") from None
    return doc

