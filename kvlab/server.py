"""An OpenAI-compatible completions server for one model and one KV format (``kvlab serve``).

It speaks the part of the API that vLLM, SGLang and llama.cpp's ``llama-server`` share and
that :mod:`kvlab.endpoint` uses: ``POST /v1/completions`` (greedy, with ``logprobs`` and
``echo``), ``GET /v1/models``, ``GET /health`` and ``POST /tokenize``. Every request runs
through a :class:`kvlab.cache.KVQuantCache` in the server's format, so two instances with two
formats are a loopback stand-in for two deployments with two ``--kv-cache-dtype`` flags.

Small on purpose: one request at a time (a lock around the model), greedy decoding only, no
streaming, no batching. The standard library's ``ThreadingHTTPServer`` does the HTTP.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from .evals import PREFILL_MODES, prefill, run_prompt
from .formats import get_format

MAX_LOGPROBS = 20
SOCKET_TIMEOUT_S = 30.0  # a client that sends nothing for this long is dropped (a half-sent request cannot pin a thread)
REQUEST_DEADLINE_S = 60.0  # and one that drips its request must have sent all of it by then
MAX_LOGPROB_ENTRIES = 100_000  # log-probabilities one answer may carry (echo x logprobs): ~10 MB of JSON at most
DRAIN_BYTES = 64 * 2**20  # of a refused (too large) body, read and dropped so the client sees the 413
MAX_CONNECTIONS = 64  # connections handled at once; more get 503 at once instead of a thread each
PREFILL_CHUNK = 8192  # prompt tokens per forward: a shutdown or a client gone is noticed between chunks
# (not smaller: on a CPU each chunk's attention re-reads the cache so far, and small chunks cost time)
MAX_JSON_DEPTH = 32  # deeper JSON is refused before parsing (Python's parser would recurse into it)
# every field of /v1/completions this server reads; anything else is refused with 400 rather than ignored
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "best_of", "stream", "logprobs", "echo",
          "stop", "seed", "presence_penalty", "frequency_penalty", "user"}


class RequestError(ValueError):
    """A request the server refuses: ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _NotStrict(ValueError):
    pass


class _HugeInt:
    """A JSON integer with more digits than Python converts (4,300 by default): kept as a placeholder so that
    the field it sits in is named by that field's own check, instead of one error for the whole body."""

    def __init__(self, digits: int):
        self.digits = digits

    def __str__(self) -> str:
        return f"an integer of {self.digits} digits"


def _json_int(text: str):
    try:
        return int(text)
    except ValueError:
        return _HugeInt(len(text.lstrip("-")))


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are all different: with a key twice, which value counts is a guess."""
    out = dict(pairs)
    if len(out) < len(pairs):
        seen, twice = set(), None
        for k, _ in pairs:
            if k in seen:
                twice = k
                break
            seen.add(k)
        raise _NotStrict(f"the key {str(twice)[:40]!r} appears twice in one object")
    return out


def _no_constant(name: str):
    raise _NotStrict(f"{name} is not a JSON number")


class ClientGone(Exception):
    """The client closed its connection while its completion was being generated."""


def _int_field(body: dict, name: str, default, lo: int, hi: int, *, nullable: bool = False):
    v = body.get(name)
    if v is None and nullable:
        return None
    if v is None:  # absent, or an explicit null: OpenAI's API reads both as "the default"
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        shown = (f"an integer of {len(str(abs(v)))} digits" if isinstance(v, int) and abs(v) > 10**30
                 else str(v) if isinstance(v, _HugeInt) else repr(str(v)[:40]))
        raise RequestError(400, f"{name!r} must be an integer in [{lo}, {hi}], got {shown}")
    return v


def _number_field(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:  # absent or null: the default
        return float(default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise RequestError(400, f"{name!r} must be a number in [{lo}, {hi}], got "
                                f"{str(v) if isinstance(v, _HugeInt) else repr(str(v)[:40])}")
    return float(v)


def _json_depth_ok(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when no array or object in ``text`` nests deeper than ``limit`` (brackets inside strings ignored)."""
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _error_doc(status: int, message: str) -> dict:
    """The OpenAI-shaped error body every answer but a success carries."""
    # 501 (a method no server implements here) and 505 (an HTTP version) answer a client's request, not a fault
    client = status < 500 or status in (501, 505)
    return {"error": {"message": message, "type": "invalid_request_error" if client else "server_error",
                      "code": status}}


def _raw_error(status: int, reason: str, message: str, headers: bytes = b"") -> bytes:
    """A whole HTTP/1.0 error answer as bytes, for the places that write straight onto a socket (a handler
    still blocked reading, a connection turned away before it has a handler)."""
    body = json.dumps(_error_doc(status, message)).encode()
    return (b"HTTP/1.0 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n" % (status, reason.encode())
            + headers + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def _listed(keys: list[str]) -> str:
    """At most five field names, each cut to 40 characters, and how many more (an error message stays short)."""
    return ", ".join(repr(k[:40]) for k in keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _route(target: str) -> str:
    """A request target's path: the absolute form (``http://host:port/health``, which RFC 9112 3.2.2 says a server
    must accept) and the origin form (``/health``) name the same route; a query string does not change it."""
    if target.lower().startswith(("http://", "https://")):
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(target)
        except ValueError:  # "http://[::1/health": not a URL
            return ""
        if not parts.netloc:  # "http:///health" names no host: no route
            return ""
        return parts.path or "/"
    return target.split("?", 1)[0]


class _Handler(BaseHTTPRequestHandler):
    """HTTP for one :class:`CompletionServer` (``server.kvlab``): validation here, the model in the server."""

    timeout = SOCKET_TIMEOUT_S  # applied to the socket by StreamRequestHandler.setup
    protocol_version = "HTTP/1.0"
    def send_error(self, code, message=None, explain=None):
        """Errors raised by http.server itself (a bad request line, headers too long) in the API's JSON shape."""
        if code == 501:  # a method http.server does not know (FOO, BREW): the client's mistake, so a 4xx
            code, message, explain = 405, "Method not allowed", "this server answers GET and POST"
        short, long = self.responses.get(code, ("error", ""))
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":  # failed before a version was read:
            self.request_version = "HTTP/1.0"  # answer with a status line and headers all the same
        try:
            if getattr(self, "command", None) == "HEAD" or code < 200 or code in (204, 304):
                self.send_response(code, message)
                self.send_header("Connection", "close")
                self.end_headers()
                return
            self._error(code, f"{message or short}: {explain or long}")
        except OSError:
            pass

    def parse_request(self):
        """As http.server does, except that a request without a version (HTTP/0.9, which would be answered with
        no status line) gets a 400 in the API's JSON shape, and empty lines before the request line are skipped
        (RFC 9112, 2.2)."""
        skipped = 0
        while self.raw_requestline in (b"\r\n", b"\n") and skipped < 8:
            self.raw_requestline = self.rfile.readline(65537)
            skipped += 1
        if not self.raw_requestline.strip():  # still blank after 8: say so rather than close without a word
            self.command, self.requestline, self.close_connection = None, "", True
            self.send_error(400, "No request line", "a request starts 'METHOD /path HTTP/1.1' (a few empty lines "
                                                    "before it are skipped)")
            return False
        if len(self.raw_requestline.split()) == 2:  # "GET /path" with no version: http.server would read headers
            self.command, self.request_version = self.raw_requestline.split()[0].decode("latin-1"), "HTTP/0.9"
            self.requestline = self.raw_requestline.decode("latin-1").rstrip("\r\n")
            self.path, self.close_connection = self.raw_requestline.split()[1].decode("latin-1"), True
            self.send_error(400, "HTTP/0.9 is not supported", "send 'METHOD /path HTTP/1.1'")  # at once, not at 30 s
            return False
        if not super().parse_request():
            return False
        if self.request_version == "HTTP/0.9":
            self.send_error(400, "HTTP/0.9 is not supported", "send 'METHOD /path HTTP/1.1'")
            return False
        # a line without a colon ends the header block for the email parser, which silently drops every header
        # after it (Content-Length included); a folded line (obs-fold) is refused too, as RFC 9112, 5.2 allows
        if self.headers.defects or self.headers.get_payload() or any("\n" in v or "\x00" in v
                                                                      for v in self.headers.values()):
            self.close_connection = True
            self.send_error(400, "Malformed header line", "every header line must be 'Name: value' on one line")
            return False
        return True

    def handle(self):
        """As http.server does, except that a TLS handshake (a client that took this plain-HTTP server for an
        https:// one) is answered at once, not when the request deadline runs out: it sends no line to wait for.
        A TLS record starts with its content type, 0x16 for a handshake; no HTTP method starts with that byte."""
        try:
            first = self.connection.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            self._timed_out()
            return
        except OSError:
            return
        if first == b"\x16" or first[:1] >= b"\x80":  # a TLS record, or an SSLv2-style hello (its high bit set)
            self._answer_early(_raw_error(400, "Bad Request", "this server speaks plain HTTP: use http://, not https://"))
            return
        super().handle()

    def setup(self):
        super().setup()
        self.read_done = False  # set once the whole request is read; a client that drips it is cut off
        self.server.reading(self)
        self._deadline = threading.Timer(REQUEST_DEADLINE_S, self._too_slow)
        self._deadline.daemon = True
        self._deadline.start()

    def finish(self):
        self._deadline.cancel()
        self.server.read(self)
        try:
            super().finish()
        except OSError:  # the client is gone: nothing left to flush to
            pass

    def _too_slow(self):
        if not self.read_done:
            self._timed_out()
            self._shut()

    def _timed_out(self):
        """408 straight onto the socket: the request was not all sent in time (the handler may be blocked reading)."""
        self._answer_early(_raw_error(408, "Request Timeout", "the request was not sent in time"))

    def _answer_early(self, raw: bytes):
        if getattr(self, "_answered_timeout", False):
            return
        self._answered_timeout = True
        try:
            self.connection.sendall(raw)
        except OSError:
            pass

    def evict(self):
        """Make room for a new connection: this one has not sent its whole request and the server is full."""
        self._answer_early(_raw_error(503, "Service Unavailable", "the server is at its connection limit and "
                                      "this connection had not sent its request; retry", b"Retry-After: 1\r\n"))
        self._shut()

    def _have_read(self):
        self.read_done = True
        self.server.read(self)

    def log_error(self, format, *args):
        # http.server reports a socket timeout while reading a request here, and sends nothing: answer it
        if format.startswith("Request timed out") and not self.read_done:
            self._timed_out()

    def _method_not_allowed(self):
        self._error(405, f"{self.command} is not supported; use GET or POST")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _method_not_allowed

    def do_HEAD(self):
        self.send_response(405)
        self.send_header("Allow", "GET, POST")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):  # quiet: the client reports
        pass

    def _send(self, status: int, doc: dict):
        data = json.dumps(doc, allow_nan=False).encode()
        # a client that reads its answer a trickle at a time is cut off like one that drips its request
        guard = threading.Timer(REQUEST_DEADLINE_S, self._shut)
        guard.daemon = True
        guard.start()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 405:  # RFC 9110, 15.5.6: a 405 names the methods the server does support
                self.send_header("Allow", "GET, POST")
            self.end_headers()
            self.wfile.write(data)
        finally:
            guard.cancel()

    def _shut(self):
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _error(self, status: int, message: str):
        self._send(status, _error_doc(status, message))

    def do_GET(self):
        srv = self.server.kvlab
        self._have_read()
        route = _route(self.path)
        if route == "/health":
            return self._send(200, {"status": "ok"})
        if route == "/v1/models":
            return self._send(200, {"object": "list", "data": [
                {"id": srv.name, "object": "model", "owned_by": "kvlab",
                 "kv_format": srv.fmt.name, "max_model_len": srv.max_context}]})
        self._error(404, f"no route GET {self.path}")

    def _drain(self, n: int) -> None:
        """Read and drop up to ``n`` bytes of a body the server refuses (briefly: a client that stops sending
        is left to the request deadline)."""
        try:
            self.connection.settimeout(1.0)
            while n > 0 and (chunk := self.rfile.read1(min(n, 1 << 16))):
                n -= len(chunk)
        except OSError:
            pass

    def _body(self) -> dict:
        """The request's JSON object, its size checked against the limit before a byte of it is read."""
        srv = self.server.kvlab
        if self.headers.get("Transfer-Encoding") is not None:  # with a Content-Length too: request smuggling
            raise RequestError(411, "this server takes a Content-Length body, not Transfer-Encoding")
        lengths = self.headers.get_all("Content-Length") or []
        if len(set(v.strip() for v in lengths)) > 1:
            raise RequestError(400, "the request has conflicting Content-Length headers")
        raw_len = lengths[0] if lengths else None
        if raw_len is None:
            raise RequestError(411, "a POST needs a Content-Length header")
        if not re.fullmatch(r"[0-9]+", raw_len.strip()):
            raise RequestError(400, f"Content-Length must be a non-negative integer, got {raw_len[:40]!r}")
        digits = raw_len.strip().lstrip("0") or "0"
        n = int(digits) if len(digits) <= 40 else 10**40  # a 40-digit length is as much too large as a 19-digit one
        if n > srv.max_body:
            self._drain(min(n, DRAIN_BYTES))  # read what we can, so that the client reads the 413 and not a reset
            raise RequestError(413, f"the request body is {n} bytes; this server takes at most {srv.max_body} "
                                    f"(prompts of up to {srv.max_context} tokens)")
        raw = self.rfile.read(n)
        if len(raw) < n:
            raise RequestError(400, f"the request body ended after {len(raw)} of {n} bytes")
        self._have_read()
        try:
            text = raw.decode("utf-8")  # JSON over HTTP is UTF-8 (RFC 8259); the depth scan reads the same text
        except UnicodeDecodeError as e:
            raise RequestError(400, f"the request body is not JSON: not UTF-8 ({e.reason})") from None
        if not _json_depth_ok(text):
            raise RequestError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
        try:
            body = json.loads(text or "null", parse_constant=_no_constant, object_pairs_hook=_unique_keys,
                              parse_int=_json_int)
        except json.JSONDecodeError as e:
            raise RequestError(400, f"the request body is not JSON: {e}") from None
        except RecursionError:
            raise RequestError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
        except _NotStrict as e:
            raise RequestError(400, f"the request body is not strict JSON: {e}") from None
        except ValueError as e:  # e.g. an integer of thousands of digits
            raise RequestError(400, f"the request body has a number out of range: {str(e)[:80]}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        return body

    def do_POST(self):
        srv = self.server.kvlab
        with contextlib.ExitStack() as answer:
            self._post(srv, answer)

    def _post(self, srv, answer):
        try:
            body = self._body()
            # from here a shutdown waits until this request's answer (a 503 if cut short) is written
            answer.enter_context(srv.answering())
            route = _route(self.path)
            if route == "/v1/completions":
                return self._send(200, srv.complete(body, gone=self._client_gone))
            if route == "/tokenize":
                return self._send(200, srv.tokenize(body))
            raise RequestError(404, f"no route POST {self.path}")
        except RequestError as e:
            self._error(e.status, str(e))
        except ClientGone:
            self.close_connection = True  # nobody to answer
        except TimeoutError:  # the body stopped arriving
            self.close_connection = True
            if not self.read_done:
                self._timed_out()
        except ConnectionError:
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a server answers 500 rather than dropping the socket
            self._error(500, f"{type(e).__name__}: {e}")

    def _client_gone(self) -> bool:
        """True when the client has closed its side (readable with nothing to read).

        A client that only half-closes (``shutdown(SHUT_WR)`` after its request, as ``nc -N`` does) looks
        the same from here and is treated as gone: HTTP/1.0 clients that want an answer keep both sides open.
        """
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


class _Server(ThreadingHTTPServer):
    """The standard threading server with a real listen backlog and a cap on connections handled at once."""

    request_queue_size = 128  # the default 5 drops connections when a few dozen clients arrive together
    daemon_threads = True

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._reading: dict = {}  # handler -> when it started reading; until its whole request is read
        self._lock = threading.Lock()

    def reading(self, handler):
        with self._lock:
            self._reading[handler] = time.monotonic()

    def read(self, handler):
        with self._lock:
            self._reading.pop(handler, None)

    def _evict_oldest_reader(self) -> bool:
        """Free a slot held by a connection that has not sent its request (an idle or dripping client: with
        every slot taken by those, no client could be served until their socket timeouts); a connection whose
        request is being answered is never evicted."""
        with self._lock:
            if not self._reading:
                return False
            oldest = min(self._reading, key=self._reading.get)
            del self._reading[oldest]
        oldest.evict()
        return True

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False) and not (
                self._evict_oldest_reader() and self._slots.acquire(timeout=2.0)):
            try:
                request.sendall(_raw_error(503, "Service Unavailable", "too many connections; retry", b"Retry-After: 1\r\n"))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request, client_address):
        """A client that went away mid-answer is not a server error: no traceback on stderr for that."""
        import sys

        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        super().handle_error(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class CompletionServer:
    """Serve ``model`` with its KV cache in ``kv_format`` on ``http://host:port`` (port 0: any free port).

    >>> with CompletionServer(model, tok, "int4") as srv:   # a background thread
    ...     print(srv.url)                                  # http://127.0.0.1:PORT

    Limits, checked where a request enters: a body of at most :attr:`max_body` bytes (derived from the
    model's context and its tokenizer's longest token, so any prompt that could fit is accepted) and a
    prompt string that cannot be longer than the context, both refused with 413 before tokenizing; a
    socket idle for :data:`SOCKET_TIMEOUT_S` is closed; a generation whose client has gone stops.
    """

    def __init__(self, model, tok, kv_format: str, *, name: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, prefill_mode: str = "full", max_tokens: int = 512, max_context: int | None = None):
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
        for arg, v in (("max_tokens", max_tokens), ("max_context", max_context)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{arg} must be a positive integer, got {v!r}")
        self.model, self.tok, self.fmt = model, tok, get_format(kv_format)
        from .budget import check_layer_types

        check_layer_types(model.config, self.fmt)  # refused at start, not with a 500 at every request
        self.name = name or Path(str(getattr(model.config, "_name_or_path", "") or "kvlab")).name or "kvlab"
        self.prefill_mode, self.max_tokens = prefill_mode, max_tokens
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", 8192)
        # a token is at most this many characters, so a longer string cannot fit in the context
        self.max_prompt_chars = self.max_context * _longest_token(tok)
        # JSON may escape each character as \uXXXX (6 bytes); token-id lists take at most 12 bytes an id
        self.max_body = 65536 + max(6 * self.max_prompt_chars, 12 * self.max_context)
        self._lock = threading.Lock()
        self.stopping = threading.Event()  # set on shutdown: a generation in progress ends with a 503
        self._answering = 0  # POST requests between arriving and their answer being written
        self._answered = threading.Condition()
        self.httpd = _Server((host, port), _Handler)
        self.httpd.kvlab = self
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> CompletionServer:
        """Serve from a background thread; a second call (``with server.start():``) is a no-op. Two loops on one
        socket would outlive close(): shutdown() stops one, and the other spins on the closed socket."""
        if self._thread is not None and self._thread.is_alive():
            return self
        # polls for shutdown every 0.1 s (http.server's 0.5 s made every close() wait half a second)
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.1,), name=f"kvlab-serve-{self.port}",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.stop_generating()
        self.httpd.server_close()

    def stop_generating(self, timeout: float = 60.0) -> bool:
        """End any generation in progress (its client gets a 503) and wait for the model to be free, so the
        process never exits while a thread is inside torch (which aborts the interpreter) or before a cut-short
        request has its answer. False on timeout."""
        self.stopping.set()
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        # the generation has ended; let its handler write the 503 before the process may exit
        with self._answered:
            return self._answered.wait_for(lambda: self._answering == 0, max(0.0, deadline - time.monotonic()))

    @contextlib.contextmanager
    def answering(self):
        with self._answered:
            self._answering += 1
        try:
            yield
        finally:
            with self._answered:
                self._answering -= 1
                self._answered.notify_all()

    def _check(self, gone) -> None:
        if self.stopping.is_set():
            raise RequestError(503, "the server is shutting down")
        if gone is not None and gone():
            raise ClientGone

    def __enter__(self) -> CompletionServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the API
    def _text(self, text: str, field: str) -> str:
        if len(text) > self.max_prompt_chars:
            raise RequestError(413, f"{field!r} has {len(text)} characters: more than the {self.max_context}-token "
                                    f"context can hold (at most {self.max_prompt_chars} characters)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(400, f"{field!r} is not valid Unicode (a lone surrogate?)") from None
        return text

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tok.encode(self._text(prompt, "prompt"), add_special_tokens=False)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(400, f"'prompt' token ids must lie in [0, {vocab})")
        else:
            raise RequestError(400, "'prompt' must be a string, a list of one string, or a list of token ids")
        if not ids:
            raise RequestError(400, "'prompt' is empty")
        return ids

    TOKENIZE_FIELDS = {"prompt", "content", "model", "add_special_tokens"}

    def tokenize(self, body: dict) -> dict:
        if unknown := sorted(set(body) - self.TOKENIZE_FIELDS):
            raise RequestError(400, f"/tokenize does not take {_listed(unknown)}; it takes 'prompt' (vLLM) or 'content' "
                                    "(llama.cpp), and optionally 'model' and 'add_special_tokens'")
        if ("prompt" in body) == ("content" in body) or not isinstance(body.get("prompt", body.get("content")), str):
            raise RequestError(400, "/tokenize takes one text: {'prompt': text} (vLLM) or {'content': text} (llama.cpp)")
        if body.get("model") is not None and not isinstance(body["model"], str):  # null: the served model, as below
            raise RequestError(400, "'model' must be a string")
        if body.get("model") not in (None, self.name):  # as /v1/completions answers
            raise RequestError(404, f"model {str(body['model'])[:80]!r} does not exist; this server serves {self.name!r}")
        special = body.get("add_special_tokens", False)
        if not isinstance(special, bool):
            raise RequestError(400, "'add_special_tokens' must be true or false")
        field = "prompt" if "prompt" in body else "content"
        ids = self.tok.encode(self._text(body[field], field), add_special_tokens=special)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_context}

    def _stop(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        stop = [stop] if isinstance(stop, str) else stop
        if (not isinstance(stop, list) or not 1 <= len(stop) <= 4
                or any(not isinstance(x, str) or not x or len(x) > 256 for x in stop)):
            raise RequestError(400, "'stop' must be a string or a list of 1 to 4 non-empty strings (each up to 256 "
                                    "characters)")
        return [self._text(x, "stop") for x in stop]

    def complete(self, body: dict, gone=None) -> dict:
        """Answer one ``/v1/completions`` request body (a dict); raises :class:`RequestError`.

        ``gone``: a callable polled between decoding steps; when it returns True the client has left
        and the generation stops (:class:`ClientGone`) instead of holding the model for nobody.
        """
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise RequestError(400, f"unsupported field(s) {_listed(unknown)}; this server reads "
                                    f"{', '.join(sorted(FIELDS))}")
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise RequestError(400, f"'model' must be a string, got {str(body['model'])[:40]!r}")
        if body.get("model") not in (None, self.name):
            raise RequestError(404, f"model {str(body['model'])[:80]!r} does not exist; this server serves {self.name!r}")
        if body.get("stream") not in (None, False) or (body.get("stream") is not None and not isinstance(body["stream"], bool)):
            raise RequestError(400, f"'stream' must be false (streaming is not supported), got {str(body['stream'])[:40]!r}")
        _int_field(body, "n", 1, 1, 1)  # only n=1: anything else is refused with its range
        _int_field(body, "best_of", 1, 1, 1)
        temp = _number_field(body, "temperature", 0, 0, 2)
        if temp != 0:
            raise RequestError(400, f"this server decodes greedily: 'temperature' must be 0, got {temp!r}")
        _number_field(body, "top_p", 1, 0, 1)  # greedy decoding: any valid top_p gives the same tokens
        _int_field(body, "seed", 0, -(2**63), 2**64 - 1, nullable=True)  # greedy: nothing random to seed
        for pen in ("presence_penalty", "frequency_penalty"):
            if _number_field(body, pen, 0, -2, 2) != 0:
                raise RequestError(400, f"{pen!r} is not supported (only 0)")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise RequestError(400, "'user' must be a string")
        max_new = _int_field(body, "max_tokens", 16, 0, self.max_tokens)
        default_new = body.get("max_tokens") is None  # OpenAI's default of 16, cut to what the context leaves
        k = _int_field(body, "logprobs", None, 0, MAX_LOGPROBS, nullable=True)
        echo = body.get("echo")
        echo = False if echo is None else echo
        if not isinstance(echo, bool):
            raise RequestError(400, f"'echo' must be true or false, got {str(echo)[:40]!r}")
        stop = self._stop(body)
        ids = self._prompt_ids(body.get("prompt"))
        if default_new and len(ids) < self.max_context:
            max_new = min(max_new, self.max_context - len(ids))
        if default_new and len(ids) >= self.max_context:  # no max_tokens given: say what was, not a default
            raise RequestError(400, f"prompt ({len(ids)} tokens) leaves no room for an answer in the model's context "
                                    f"of {self.max_context} tokens")
        if len(ids) + max_new > self.max_context:
            raise RequestError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceeds the "
                                    f"model's context of {self.max_context}")
        entries = (len(ids) * echo + max_new) * ((k or 0) + 1) if k is not None else 0
        if entries > MAX_LOGPROB_ENTRIES:  # one request must not hold the model for a minute and answer megabytes
            raise RequestError(400, f"this request would return {entries:,} log-probabilities ("
                                    f"{'prompt + ' if echo else ''}{max_new} new tokens, x {k + 1}: each token's own and {k} "
                                    f"alternatives); at most "
                                    f"{MAX_LOGPROB_ENTRIES:,}: lower 'logprobs' or send a shorter prompt")
        with self._lock, torch.no_grad():
            self._check(gone)
            new, steps, prompt_lp, stopped = self._generate(ids, max_new, k, echo, stop, gone)
        return self._response(ids, new, steps, prompt_lp, k, echo, stop, stopped)

    def _generate(self, ids: list[int], max_new: int, k, echo: bool, stop=(), gone=None):
        """Greedy tokens, each step's log-probabilities, (with echo) the prompt's, and whether a stop string ended it."""
        from .cache import KVQuantCache

        model, dev = self.model, next(self.model.parameters()).device
        x = torch.tensor([ids], device=dev)
        if self.prefill_mode == "full":
            if echo:
                from transformers import DynamicCache

                dyn = DynamicCache(config=model.config)
                logits = self._all_logits(x, dyn, gone)
            else:  # in chunks, checking between them: a stop or a client gone ends a long prefill early
                dyn, last = prefill(model, x, PREFILL_CHUNK, between=lambda: self._check(gone))
                logits = last
            cache = KVQuantCache.from_prefill(self.fmt, dyn)
        else:
            cache = KVQuantCache(self.fmt, quantize_prefill=True, config=model.config)
            if echo:
                logits = self._all_logits(x, cache, gone)
            else:
                logits = run_prompt(model, x, cache, PREFILL_CHUNK, between=lambda: self._check(gone))
        logits = logits.float().reshape(-1, logits.shape[-1])
        prompt_lp = torch.log_softmax(logits[:-1], -1) if echo else None
        step = torch.log_softmax(logits[-1], -1)
        new, steps, eos = [], [], self.tok.eos_token_id
        for i in range(max_new):
            nxt = int(step.argmax())
            new.append(nxt)
            steps.append(step)
            if stop and any(s in self.tok.decode(new) for s in stop):
                return new, steps, prompt_lp, True
            if nxt == eos or i == max_new - 1:
                break
            self._check(gone)
            out = model(torch.tensor([[nxt]], device=dev), past_key_values=cache, use_cache=True)
            step = torch.log_softmax(out.logits[0, -1].float(), -1)
        return new, steps, prompt_lp, False

    def _all_logits(self, x: torch.Tensor, cache, gone) -> torch.Tensor:
        """Every prompt position's logits (echo's log-probabilities), ``PREFILL_CHUNK`` tokens per forward with a
        stop check between chunks, as the prefill without echo."""
        out = []
        for s in range(0, x.shape[1], PREFILL_CHUNK):
            if s:
                self._check(gone)
            out.append(self.model(x[:, s:s + PREFILL_CHUNK], past_key_values=cache, use_cache=True).logits[0])
        return torch.cat(out)

    def _piece(self, t: int) -> str:
        return self.tok.decode([t])

    def _top(self, lp: torch.Tensor, k: int) -> dict[str, float]:
        vals, idx = lp.topk(max(k, 1))
        top: dict[str, float] = {}
        for v, i in zip(vals.tolist(), idx.tolist()):
            top.setdefault(self._piece(i), _logprob(v))  # two ids that decode alike: the likelier one
        return top

    def _response(self, ids, new, steps, prompt_lp, k, echo, stop=(), stopped=False) -> dict:
        text = self.tok.decode(new)
        if stopped:  # the text ends before the first stop string, as OpenAI's and vLLM's do
            text = text[:min(text.find(s) for s in stop if s in text)]
        eos = self.tok.eos_token_id
        finish = "stop" if stopped or (new and new[-1] == eos) else "length"
        logprobs = None
        if k is not None:
            toks, tlp, tops = [], [], []
            if echo:
                toks += [self._piece(t) for t in ids]
                tlp += [None] + [_logprob(prompt_lp[i, t]) for i, t in enumerate(ids[1:])]
                tops += [None] + [self._top(prompt_lp[i], k) for i in range(len(ids) - 1)]
            for t, lp in zip(new, steps):
                toks.append(self._piece(t))
                tlp.append(_logprob(lp[t]))
                tops.append(self._top(lp, k))
            offsets, pos = [], 0
            for piece in toks:
                offsets.append(pos)
                pos += len(piece)
            logprobs = {"tokens": toks, "token_logprobs": tlp, "top_logprobs": tops, "text_offset": offsets}
        prompt_text = self.tok.decode(ids) if echo else ""
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": self.name, "kv_format": self.fmt.name,
            "choices": [{"index": 0, "text": prompt_text + text, "logprobs": logprobs, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)},
        }


def _longest_token(tok) -> int:
    """The most characters one token of ``tok`` decodes to (at least 16: byte fallbacks and added tokens)."""
    try:
        vocab = tok.get_vocab()
    except (AttributeError, TypeError):
        return 64
    return max(16, max((len(t) for t in vocab), default=16))


LOGPROB_FLOOR = -9999.0  # what vLLM's OpenAI server reports for a probability of zero (strict JSON has no -Infinity)


def _logprob(v) -> float:
    v = float(v)
    if math.isnan(v):
        raise ValueError("the model produced a NaN log-probability")
    return max(v, LOGPROB_FLOOR)
