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

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from .evals import PREFILL_MODES, prefill
from .formats import get_format

MAX_LOGPROBS = 20


class RequestError(ValueError):
    """A request the server refuses: ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _int_field(body: dict, name: str, default, lo: int, hi: int):
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(400, f"{name!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


class CompletionServer:
    """Serve ``model`` with its KV cache in ``kv_format`` on ``http://host:port`` (port 0: any free port).

    >>> with CompletionServer(model, tok, "int4") as srv:   # a background thread
    ...     print(srv.url)                                  # http://127.0.0.1:PORT
    """

    def __init__(self, model, tok, kv_format: str, *, name: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, prefill_mode: str = "full", max_tokens: int = 512, max_context: int | None = None):
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
        self.model, self.tok, self.fmt = model, tok, get_format(kv_format)
        self.name = name or getattr(model.config, "_name_or_path", "") or "kvlab"
        self.prefill_mode, self.max_tokens = prefill_mode, max_tokens
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", 8192)
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the client reports
                pass

            def _send(self, status: int, doc: dict):
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str):
                self._send(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, {"status": "ok"})
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [
                        {"id": server.name, "object": "model", "owned_by": "kvlab",
                         "kv_format": server.fmt.name, "max_model_len": server.max_context}]})
                self._error(404, f"no route GET {self.path}")

            def do_POST(self):
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(n) or b"null")
                    if not isinstance(body, dict):
                        raise RequestError(400, "the request body must be a JSON object")
                    if self.path == "/v1/completions":
                        return self._send(200, server.complete(body))
                    if self.path == "/tokenize":
                        return self._send(200, server.tokenize(body))
                    raise RequestError(404, f"no route POST {self.path}")
                except json.JSONDecodeError as e:
                    self._error(400, f"the request body is not JSON: {e}")
                except RequestError as e:
                    self._error(e.status, str(e))
                except Exception as e:  # noqa: BLE001 - a server answers 500 rather than dropping the socket
                    self._error(500, f"{type(e).__name__}: {e}")

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> CompletionServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=f"kvlab-serve-{self.port}", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> CompletionServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the API
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tok.encode(prompt, add_special_tokens=False)
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

    def tokenize(self, body: dict) -> dict:
        text = body.get("prompt", body.get("content"))
        if not isinstance(text, str):
            raise RequestError(400, "/tokenize takes {'prompt': text} (vLLM) or {'content': text} (llama.cpp)")
        ids = self.tok.encode(text, add_special_tokens=False)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_context}

    def complete(self, body: dict) -> dict:
        """Answer one ``/v1/completions`` request body (a dict); raises :class:`RequestError`."""
        if body.get("model") not in (None, self.name):
            raise RequestError(404, f"model {body['model']!r} does not exist; this server serves {self.name!r}")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported")
        _int_field(body, "n", 1, 1, 1)  # only n=1: anything else is refused with its range
        if body.get("best_of", 1) != 1:
            raise RequestError(400, "only best_of=1 is supported")
        temp = body.get("temperature", 0)
        if not isinstance(temp, int | float) or temp != 0:
            raise RequestError(400, f"this server decodes greedily: 'temperature' must be 0, got {temp!r}")
        max_new = _int_field(body, "max_tokens", 16, 0, self.max_tokens)
        k = _int_field(body, "logprobs", None, 0, MAX_LOGPROBS)
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise RequestError(400, f"'echo' must be true or false, got {echo!r}")
        ids = self._prompt_ids(body.get("prompt"))
        if len(ids) + max_new > self.max_context:
            raise RequestError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceeds the "
                                    f"model's context of {self.max_context}")
        with self._lock, torch.no_grad():
            new, steps, prompt_lp = self._generate(ids, max_new, k, echo)
        return self._response(ids, new, steps, prompt_lp, k, echo)

    def _generate(self, ids: list[int], max_new: int, k, echo: bool):
        """Greedy tokens, each step's log-probabilities, and (with echo) the prompt's."""
        from .cache import KVQuantCache

        model, dev = self.model, next(self.model.parameters()).device
        x = torch.tensor([ids], device=dev)
        if self.prefill_mode == "full":
            if echo:
                from transformers import DynamicCache

                dyn = DynamicCache(config=model.config)
                logits = model(x, past_key_values=dyn, use_cache=True).logits[0]
            else:
                dyn, last = prefill(model, x)
                logits = last
            cache = KVQuantCache.from_prefill(self.fmt, dyn)
        else:
            cache = KVQuantCache(self.fmt, quantize_prefill=True)
            logits = model(x, past_key_values=cache, use_cache=True, **({} if echo else {"logits_to_keep": 1})).logits[0]
        logits = logits.float().reshape(-1, logits.shape[-1])
        prompt_lp = torch.log_softmax(logits[:-1], -1) if echo else None
        step = torch.log_softmax(logits[-1], -1)
        new, steps, eos = [], [], self.tok.eos_token_id
        for i in range(max_new):
            nxt = int(step.argmax())
            new.append(nxt)
            steps.append(step)
            if nxt == eos or i == max_new - 1:
                break
            out = model(torch.tensor([[nxt]], device=dev), past_key_values=cache, use_cache=True)
            step = torch.log_softmax(out.logits[0, -1].float(), -1)
        return new, steps, prompt_lp

    def _piece(self, t: int) -> str:
        return self.tok.decode([t])

    def _top(self, lp: torch.Tensor, k: int) -> dict[str, float]:
        vals, idx = lp.topk(max(k, 1))
        top: dict[str, float] = {}
        for v, i in zip(vals.tolist(), idx.tolist()):
            top.setdefault(self._piece(i), v)  # two ids that decode alike: the likelier one
        return top

    def _response(self, ids, new, steps, prompt_lp, k, echo) -> dict:
        text = self.tok.decode(new)
        eos = self.tok.eos_token_id
        finish = "stop" if new and new[-1] == eos else "length"
        logprobs = None
        if k is not None:
            toks, tlp, tops = [], [], []
            if echo:
                toks += [self._piece(t) for t in ids]
                tlp += [None] + [float(prompt_lp[i, t]) for i, t in enumerate(ids[1:])]
                tops += [None] + [self._top(prompt_lp[i], k) for i in range(len(ids) - 1)]
            for t, lp in zip(new, steps):
                toks.append(self._piece(t))
                tlp.append(float(lp[t]))
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
