"""kvlab serve under hostile clients: limits before work, 4xx for client errors, timeouts, cancellation, strict JSON."""

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab import server as S


@pytest.fixture(scope="module")
def srv(shipped):
    model, tok = shipped
    s = S.CompletionServer(model, tok, "int8", name="tiny", max_context=256).start()
    yield s
    s.close()


def _post(srv, body=None, *, raw: bytes | None = None, headers=None, path="/v1/completions"):
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, headers=headers or {}, timeout=30)


def _raw(srv, data: bytes, wait: float = 5.0) -> bytes:
    """Send bytes on a fresh socket and read whatever comes back (the status line is what matters)."""
    with socket.create_connection((srv.host, srv.port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(4096):
                out += chunk
        except TimeoutError:
            pass
    return out


def test_start_twice_is_one_server_and_close_leaves_no_thread(shipped):
    """``with server.start():`` starts once: two serve loops on one socket outlived close() and spun on the
    closed socket, slowing every test after them."""
    model, tok = shipped
    with S.CompletionServer(model, tok, "int8", name="tiny", max_context=64).start() as s:
        assert s.start() is s
        assert [t.name for t in threading.enumerate()].count(f"kvlab-serve-{s.port}") == 1
    time.sleep(0.3)
    assert not [t for t in threading.enumerate() if t.name == f"kvlab-serve-{s.port}"]


def test_a_format_for_layers_the_model_lacks_is_refused_at_start(shipped):
    """kvlab-tiny has no sliding-window layers: int4@sliding would quantize nothing (it answered every request with
    a 500 before)."""
    model, tok = shipped
    with pytest.raises(ValueError, match="quantizes sliding attention layers; .* has none"):
        S.CompletionServer(model, tok, "int4@sliding")


def test_the_absolute_form_of_a_request_target_names_the_same_route(srv):
    """RFC 9112 3.2.2: a server must accept ``GET http://host:port/health`` as it accepts ``GET /health``."""
    for target in (f"http://{srv.host}:{srv.port}/health", f"HTTP://{srv.host}:{srv.port}/health?probe=1"):
        out = _raw(srv, f"GET {target} HTTP/1.1\r\nHost: {srv.host}\r\nConnection: close\r\n\r\n".encode())
        assert out.startswith(b"HTTP/1.") and b" 200 " in out.split(b"\r\n")[0], out[:80]
    assert S._route("http://h:1") == "/" and S._route("/v1/models?x") == "/v1/models"
    assert S._route("http:///health") == "" and S._route("http://[::1/health") == ""  # no host, not a URL: no route


def test_the_model_id_is_a_name_not_a_path(shipped):
    model, tok = shipped
    s = S.CompletionServer(model, tok, "fp32")
    try:
        assert "/" not in s.name and s.name
    finally:
        s.httpd.server_close()


@pytest.mark.slow  # waits out a timeout: make test, not make quick
def test_an_oversized_body_is_refused_before_it_is_read(srv):
    head = _raw(srv, b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n{}" % (srv.max_body + 1))
    assert head.startswith(b"HTTP/1.0 413 ") and b"at most" in head


def test_a_prompt_longer_than_the_context_could_hold_is_413_before_tokenizing(srv, monkeypatch):
    calls = []
    monkeypatch.setattr(srv.tok, "encode", lambda *a, **k: calls.append(1) or [1])
    r = _post(srv, {"prompt": "a" * (srv.max_prompt_chars + 1)})
    assert r.status_code == 413 and "characters" in r.json()["error"]["message"] and not calls


@pytest.mark.parametrize("body, status, why", [
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "stop": ""}, 400, "stop"),
    ({"prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ({"prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"prompt": "x", "presence_penalty": 1}, 400, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, 400, "unsupported field"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "seed": 1.5}, 400, "seed"),
    ({"prompt": "x", "model": "gpt"}, 404, "does not exist"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
])
def test_client_errors_are_4xx_with_a_message(srv, body, status, why):
    r = _post(srv, body)
    assert r.status_code == status and why in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("raw, why", [
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "an integer of 5000 digits"),
    (b"[" * 10_000 + b"]" * 10_000, "deeper"),
    (b'{"prompt": "\\ud800"}', "Unicode"),
    (b"\xff\xfe", "not JSON"),
    (b'"a string"', "JSON object"),
    (b'{"prompt": "x", "top_p": NaN}', "strict JSON"),
])
def test_malformed_bodies_are_400(srv, raw, why):
    r = _post(srv, raw=raw)
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_bad_content_length_headers(srv):
    assert b" 400 " in _raw(srv, b"POST /v1/completions HTTP/1.0\r\nContent-Length: abc\r\n\r\n{}").split(b"\r\n")[0]
    assert b" 400 " in _raw(srv, b"POST /v1/completions HTTP/1.0\r\nContent-Length: -1\r\n\r\n").split(b"\r\n")[0]
    assert b" 411 " in _raw(srv, b"POST /v1/completions HTTP/1.0\r\n\r\n").split(b"\r\n")[0]


@pytest.mark.slow  # waits out a timeout: make test, not make quick
def test_a_half_sent_body_does_not_hold_a_thread(srv, monkeypatch):
    monkeypatch.setattr(S._Handler, "timeout", 0.5)
    t0 = time.time()
    out = _raw(srv, b"POST /v1/completions HTTP/1.0\r\nContent-Length: 100\r\n\r\n{\"pro", wait=10)
    assert out.startswith(b"HTTP/1.0 408 ") and time.time() - t0 < 5  # answered, then dropped, at the socket timeout


@pytest.mark.slow  # waits out a timeout: make test, not make quick
def test_an_idle_connection_is_dropped(srv, monkeypatch):
    monkeypatch.setattr(S._Handler, "timeout", 0.5)
    with socket.create_connection((srv.host, srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\n")  # and then nothing
        t0 = time.time()
        out = b""
        while chunk := s.recv(4096):
            out += chunk
        assert out.startswith(b"HTTP/1.0 408 ")  # told why, then closed
        assert time.time() - t0 < 5


@pytest.mark.slow  # waits out a timeout: make test, not make quick
def test_idle_connections_cannot_lock_out_a_real_client(shipped, monkeypatch):
    """Every slot held by clients that connect and send nothing: a real request is still served at once, and the
    oldest idle connection is told why it was dropped (not a 503 for everyone until the socket timeouts)."""
    monkeypatch.setattr(S, "MAX_CONNECTIONS", 4)
    model, tok = shipped
    with S.CompletionServer(model, tok, "int8", name="tiny", max_context=256).start() as small:
        idle = [socket.create_connection((small.host, small.port), timeout=10) for _ in range(4)]
        try:
            time.sleep(0.3)  # all four handed to their threads, each waiting for a request line
            t0 = time.time()
            assert httpx.get(small.url + "/health", timeout=10).status_code == 200
            assert time.time() - t0 < 3
            import select

            ready, _, _ = select.select(idle, [], [], 5)  # the oldest handler is evicted (thread start order varies)
            assert len(ready) == 1, ready
            out = b""
            while chunk := ready[0].recv(4096):
                out += chunk
            assert out.startswith(b"HTTP/1.0 503 ") and b"connection limit" in out
        finally:
            for c in idle:
                c.close()


def test_stop_strings_end_the_text_and_the_generation(srv):
    base = _post(srv, {"prompt": "The cat sat on the", "max_tokens": 24}).json()["choices"][0]
    assert base["finish_reason"] == "length" and len(base["text"]) > 4
    cut = base["text"][2:4]
    r = _post(srv, {"prompt": "The cat sat on the", "max_tokens": 24, "stop": [cut, "\x00never"], "logprobs": 1}).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["text"] == base["text"][:base["text"].find(cut)]
    assert r["usage"]["completion_tokens"] < 24 and len(ch["logprobs"]["tokens"]) == r["usage"]["completion_tokens"]
    ok = _post(srv, {"prompt": "x", "max_tokens": 2, "top_p": 0.9, "seed": 7, "user": "u", "presence_penalty": 0})
    assert ok.status_code == 200
    null = _post(srv, {"prompt": "x", "max_tokens": None})  # OpenAI's API: null means the default (16)
    assert null.status_code == 200 and null.json()["usage"]["completion_tokens"] <= 16


@pytest.mark.slow  # seconds of waiting: in make test, not make quick
def test_a_generation_stops_when_its_client_has_gone(srv, monkeypatch):
    steps = []
    real = srv.model.forward

    def slow(*a, **k):
        steps.append(1)
        time.sleep(0.05)
        return real(*a, **k)

    monkeypatch.setattr(srv.model, "forward", slow)
    body = json.dumps({"prompt": "hello", "max_tokens": 200}).encode()
    with socket.create_connection((srv.host, srv.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)
    time.sleep(1.0)
    n = len(steps)
    time.sleep(0.5)
    assert len(steps) == n and n < 100  # it stopped, well before 200 steps
    monkeypatch.setattr(srv.model, "forward", real)
    assert _post(srv, {"prompt": "hello", "max_tokens": 2}).status_code == 200  # and the lock was released


def test_log_probabilities_are_finite_json(srv):
    r = _post(srv, {"prompt": "abc", "max_tokens": 3, "logprobs": 5, "echo": True})
    doc = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"non-finite {c} in the answer"))
    lps = [x for x in doc["choices"][0]["logprobs"]["token_logprobs"] if x is not None]
    assert lps and all(S.LOGPROB_FLOOR <= x <= 0 for x in lps)
    assert S._logprob(float("-inf")) == S.LOGPROB_FLOOR
    with pytest.raises(ValueError, match="NaN"):
        S._logprob(float("nan"))


@pytest.mark.slow  # seconds: in make test, not make quick
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(sorted(S.FIELDS) + ["junk"]),
                            st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False),
                                      st.text(max_size=20), st.lists(st.integers(-5, 400), max_size=5)),
                            max_size=6))
def test_any_body_gets_200_or_a_4xx_never_a_500(srv, body):
    body.setdefault("prompt", "hi")
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)
    r = _post(srv, raw=json.dumps(body).encode())
    assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.text)


@pytest.mark.slow  # waits out a timeout: make test, not make quick
def test_many_clients_at_once_all_get_answers(srv):
    codes = []

    def one(i):
        body = {"prompt": "hello", "max_tokens": 2} if i % 2 else {"prompt": "x", "top_p": 5}
        codes.append(_post(srv, body).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(set(codes)) == [200, 400] and len(codes) == 20


def _rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow
def test_soak_fifty_clients_good_and_hostile_then_a_fresh_answer(shipped):
    """50 clients for 60 s, mixing good requests with hostile ones; afterwards the server answers a good
    request exactly as a fresh server does, and its memory has not grown without bound."""
    model, tok = shipped
    good = {"prompt": "The cat sat on the", "max_tokens": 4, "logprobs": 2}
    hostile = [b"{not json", b"[" * 5000 + b"]" * 5000, json.dumps({"prompt": "x", "top_p": 9}).encode(),
               json.dumps({"prompt": "a" * 10_000}).encode(), json.dumps({"prompt": [10**9]}).encode(),
               b'{"prompt": "\\ud800"}', json.dumps({"prompt": "x", "max_tokens": None}).encode()]
    with S.CompletionServer(model, tok, "int8", name="tiny", max_context=256) as fresh:
        want = httpx.post(fresh.url + "/v1/completions", json=good, timeout=60).json()["choices"][0]
    s = S.CompletionServer(model, tok, "int8", name="tiny", max_context=256).start()
    try:
        codes, stop = [], time.time() + 60
        before = _rss_mib()

        def client(i):
            n = 0
            while time.time() < stop:
                n += 1
                if (i + n) % 3 == 0:
                    codes.append(httpx.post(s.url + "/v1/completions", json=good, timeout=60).status_code)
                elif (i + n) % 7 == 0:  # gone mid-request
                    with socket.create_connection((s.host, s.port)) as c:
                        c.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: 50\r\n\r\n{")
                else:
                    raw = hostile[(i + n) % len(hostile)]
                    codes.append(httpx.post(s.url + "/v1/completions", content=raw, timeout=60).status_code)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert codes and all(c == 200 or 400 <= c < 500 for c in codes), sorted(set(codes))
        assert 200 in codes and any(400 <= c < 500 for c in codes)
        got = httpx.post(s.url + "/v1/completions", json=good, timeout=60).json()["choices"][0]
        assert got["text"] == want["text"] and got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
        assert _rss_mib() - before < 300, (before, _rss_mib())
    finally:
        s.close()


@pytest.mark.parametrize("raw, why", [
    # UTF-16 hides a quote inside a wide character from a byte scanner: the text is UTF-8 or refused
    (('{"user":"\u2200' + "\u5d5d" * 50 + '\u2200","prompt":' + "[" * 500 + "1" + "]" * 500 + "}").encode("utf-16-le"),
     "deeper|not UTF-8|not JSON"),
    (b'{"prompt": "x", "model": ["a"]}', "'model' must be a string"),
    (b'{"prompt": "x", "stream": "false"}', "'stream' must be false"),
])
def test_more_hostile_bodies_are_400(srv, raw, why):
    import re

    r = _post(srv, raw=raw)
    assert r.status_code == 400 and re.search(why, r.json()["error"]["message"]), r.text


@pytest.mark.slow  # waits out a timeout: make test, not make quick
@pytest.mark.parametrize("value", ["\xb2", "1" * 5000, "+5", " 1e3"])
def test_odd_content_length_values_are_400_or_413(srv, value):
    head = _raw(srv, b"POST /v1/completions HTTP/1.0\r\nContent-Length: " + value.encode("latin-1") + b"\r\n\r\n{}")
    want = b"HTTP/1.0 413 " if value.isascii() and value.isdigit() else b"HTTP/1.0 400 "  # a valid length, just far too large
    assert head.startswith(want), head[:80]


def test_the_http_layer_answers_in_json_and_other_methods_get_405(srv):
    for method in ("PUT", "DELETE", "OPTIONS", "PATCH"):
        r = httpx.request(method, srv.url + "/v1/completions", timeout=10)
        assert r.status_code == 405 and "not supported" in r.json()["error"]["message"]
    assert httpx.head(srv.url + "/health", timeout=10).status_code == 405
    head = _raw(srv, b"GET /health HTTP/2.0\r\n\r\n")
    body = head.split(b"\r\n\r\n", 1)[-1]
    assert json.loads(body)["error"]["code"] == 505 or b"505" in head


@pytest.mark.slow  # waits out a timeout: make test, not make quick
def test_a_client_dripping_its_request_is_cut_off_at_the_deadline(srv, monkeypatch):
    monkeypatch.setattr(S, "REQUEST_DEADLINE_S", 1.0)
    with socket.create_connection((srv.host, srv.port), timeout=10) as s:
        t0 = time.time()
        for byte in b"POST /v1/completions HTTP/1.0\r\n":
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
            if time.time() - t0 > 8:
                break
        assert time.time() - t0 < 8  # cut off well before the whole line was dripped (6 s)


@pytest.mark.slow  # waits out a timeout: make test, not make quick
def test_a_burst_of_connections_is_not_dropped(srv):
    out = []

    def one():
        out.append(httpx.get(srv.url + "/health", timeout=30).status_code)

    threads = [threading.Thread(target=one) for _ in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == 60 and set(out) <= {200, 503}


def test_http_09_gets_a_status_line_and_tokenize_refuses_unknown_fields(srv):
    head = _raw(srv, b"GET /health\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 400 ") and b"HTTP/0.9" in head
    t0 = time.time()
    with socket.create_connection((srv.host, srv.port), timeout=10) as s:  # one line, no blank line after it
        s.sendall(b"GET /health\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.0 400 ") and time.time() - t0 < 5  # at once, not at the timeout
    brew = _raw(srv, b"BREW /pot HTTP/1.1\r\n\r\n")  # a method it does not know: the client's mistake, a 4xx
    assert brew.startswith(b"HTTP/1.0 405 ") and b"\"invalid_request_error\"" in brew, brew[:200]
    # a TLS ClientHello (https:// against this plain-HTTP server) has no line to wait for: answered at once
    t0 = time.time()
    head = _raw(srv, bytes.fromhex("16030100c4010000c00303") + bytes(32), wait=10)
    assert head.startswith(b"HTTP/1.0 400 ") and b"http://" in head and time.time() - t0 < 5
    t0 = time.time()  # an SSLv2-style hello (first byte with its high bit set): the same, at once
    head = _raw(srv, bytes.fromhex("802b01030100120000001000") + bytes(16), wait=10)
    assert head.startswith(b"HTTP/1.0 400 ") and b"http://" in head and time.time() - t0 < 5
    # more empty lines than are skipped before a request line: a 400 that says so, not a silent close
    assert b"No request line" in _raw(srv, b"\r\n" * 9 + b"GET /health HTTP/1.1\r\n\r\n")
    assert _raw(srv, b"\r\n" * 3 + b"GET /health HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 200 ")
    r = _post(srv, {"prompt": "hi", "add_special_tokens": False, "bogus": 1}, path="/tokenize")
    assert r.status_code == 400 and "'bogus'" in r.json()["error"]["message"]
    assert _post(srv, {"prompt": "hi", "model": "tiny"}, path="/tokenize").json()["count"] >= 1


@pytest.mark.parametrize("headers", [b"Host: x\r\nNoColonHere\r\nContent-Length: 2\r\n",
                                     b"Host: x\r\n folded\r\nContent-Length: 2\r\n",
                                     b"Host: x\r\nX-A: a\x00b\r\nContent-Length: 2\r\n"])
def test_a_header_line_that_is_not_name_colon_value_is_refused(srv, headers):
    # the email parser would end the headers at such a line and drop Content-Length after it
    head = _raw(srv, b"POST /v1/completions HTTP/1.1\r\n" + headers + b"\r\n{}")
    assert head.startswith(b"HTTP/1.0 400 ") and b"Malformed header line" in head, head[:300]
    assert _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.0 200 ")


@pytest.mark.parametrize("line", [b"POST /v1/completions\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n", b"GET /health HTTP/1.1x\r\n\r\n",
                                  b"GET\r\n\r\n", b"GET / a b HTTP/1.1\r\n\r\n", b"\x00\xff\xfe junk\r\n\r\n"])
def test_every_malformed_request_line_gets_a_status_line(srv, line):
    head = _raw(srv, line)
    assert head.startswith(b"HTTP/1.0 4") or head.startswith(b"HTTP/1.0 5"), head[:80]
    assert b'"error"' in head


def test_smuggling_shapes_are_refused(srv):
    both = _raw(srv, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}")
    assert both.startswith(b"HTTP/1.0 411 ")
    two = _raw(srv, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}")
    assert two.startswith(b"HTTP/1.0 400 ") and b"conflicting" in two


@pytest.mark.parametrize("body, match", [({"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
                                         ({"prompt": "hi", "model": {"a": 1}}, "'model'"),
                                         ({"prompt": "hi", "content": [1]}, "one text"),
                                         ({f"k{i}": 1 for i in range(2000)}, "and 1995 more")])
def test_tokenize_checks_what_it_takes(srv, body, match):
    r = _post(srv, body, path="/tokenize")
    assert r.status_code == 400 and match in r.json()["error"]["message"] and len(r.text) < 2000


@pytest.mark.slow  # sends a body past the limit: in make test, not make quick
def test_a_huge_body_gets_its_413_and_leading_empty_lines_are_skipped(srv):
    """A body over the limit is read and dropped, so a client that sends it all still reads the 413 (not a
    reset); a 40-digit Content-Length is 413 too; empty lines before the request line are skipped (RFC 9112)."""
    import socket

    host, port = srv.host, srv.port
    big = b"x" * (srv.max_body + 1)
    with socket.create_connection((host, port), timeout=20) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(big) + big)
        assert c.recv(4096).startswith(b"HTTP/1.0 413")
    with socket.create_connection((host, port), timeout=20) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 40 + b"\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.0 413")
    with socket.create_connection((host, port), timeout=20) as c:
        c.sendall(b"\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.0 200")


def test_tokenize_names_the_model_as_completions_does_and_huge_logprob_answers_are_refused(srv):
    r = _post(srv, {"prompt": "hello", "model": "gpt-4"}, path="/tokenize")
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    assert _post(srv, {"prompt": "hello", "model": "tiny"}, path="/tokenize").status_code == 200
    ids = list(range(5, 205))  # 200 prompt tokens x 20 alternatives, echoed: 4,200 entries, allowed
    ok = _post(srv, {"prompt": ids, "max_tokens": 1, "logprobs": 20, "echo": True})
    assert ok.status_code == 200, ok.text
    monkey = S.MAX_LOGPROB_ENTRIES
    try:
        S.MAX_LOGPROB_ENTRIES = 1000
        r = _post(srv, {"prompt": ids, "max_tokens": 1, "logprobs": 20, "echo": True})
        assert r.status_code == 400 and "log-probabilities" in r.json()["error"]["message"]
    finally:
        S.MAX_LOGPROB_ENTRIES = monkey


def _serve_process(**popen):
    """``kvlab serve`` on kvlab-tiny in its own process, on a free port, once it answers /health: (proc, port)."""
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvlab", "serve", "--model", "kvlab-tiny", "--kv-format", "int8",
                             "--port", str(free)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{free}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    return proc, free


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_during_a_generation_stops_cleanly(tmp_path, sig):
    """SIGINT (Ctrl-C) or SIGTERM (docker stop, systemd) while a request is generating: the request is answered
    503 (or completes), the process exits 0 with a line on stderr, never aborting inside torch ('terminate
    called without an active exception')."""
    import signal

    proc, free = _serve_process(preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        url = f"http://127.0.0.1:{free}"
        answer = {}

        def ask():
            try:
                r = httpx.post(url + "/v1/completions", json={"prompt": list(range(5, 1500)), "max_tokens": 512},
                               timeout=120)
                answer["status"] = r.status_code
            except httpx.HTTPError as e:
                answer["error"] = repr(e)

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(3)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=120)
        t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "terminate called" not in err and "Traceback" not in err, err[-2000:]
    assert answer.get("status") in (200, 503), answer


@pytest.mark.slow
def test_a_second_signal_during_one_long_step_forces_a_clean_exit(tmp_path):
    """The first SIGTERM waits for the model's current step; a second one, while that step (here one forward
    over an 8k-token chunk of a 32k-token echoed prompt) still runs, exits at once with 130: not an abort inside torch.
    The chunks grow longer as the prompt fills (seconds each on a CPU); where the step in progress ends inside the
    window between the two signals (so the server exits 0 after answering 503), the test tries a later moment, in a
    longer chunk: a server that ignored the second signal would exit 0 every time and fail."""
    import signal

    tries = []
    for delay in (2.0, 5.0, 9.0):
        proc, free = _serve_process()
        try:
            url = f"http://127.0.0.1:{free}"

            def ask(url=url):
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(url + "/v1/completions", json={"prompt": [5] * 32000, "max_tokens": 1, "echo": True},
                               timeout=120)

            threading.Thread(target=ask, daemon=True).start()
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(ConnectionRefusedError):  # the listening socket closed with the first signal
                socket.create_connection(("127.0.0.1", free), timeout=5).close()
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        tries.append((delay, proc.returncode))
        if proc.returncode == 130 or "forced to stop" in err:
            break
    assert proc.returncode == 130 and "forced to stop" in err, (tries, err[-2000:])
    assert "terminate called" not in err and "Traceback" not in err, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("gap", [0.05, 0.5])
def test_a_second_signal_while_an_idle_server_winds_down_exits_130_not_143(gap):
    """After the first SIGTERM no step runs, but the process takes a moment to exit: a second SIGTERM then is
    not left to the default handler (exit 143, no message)."""
    import signal

    proc, _ = _serve_process()
    try:
        proc.send_signal(signal.SIGTERM)
        time.sleep(gap)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    except BaseException:
        proc.kill()
        raise
    _assert_stopped_cleanly(proc)


def _assert_stopped_cleanly(proc):
    """Wait for a signalled ``kvlab serve`` (killing it if it hangs): exit 0 or 130, never a kill by signal, a
    traceback or an abort inside torch."""
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (0, 130), (proc.returncode, err[-2000:])
    assert "terminate called" not in err and "Traceback" not in err, err[-2000:]


@pytest.mark.slow
def test_sigterm_while_the_model_loads_is_an_interruption_not_a_kill():
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvlab", "serve", "--model", "kvlab-tiny", "--kv-format", "int8",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "loading" in proc.stdout.readline()  # printed once the handler is in place, before the model loads
        proc.send_signal(signal.SIGTERM)
    except BaseException:
        proc.kill()
        raise
    _assert_stopped_cleanly(proc)


def test_an_explicit_null_is_the_default_for_every_optional_field(srv):
    base = _post(srv, {"prompt": "The cat", "max_tokens": 3}).json()["choices"][0]["text"]
    nulls = {f: None for f in ("temperature", "top_p", "n", "best_of", "echo", "presence_penalty",
                               "frequency_penalty", "max_tokens", "seed", "stream", "logprobs", "stop", "user")}
    r = _post(srv, {"prompt": "The cat", **nulls} | {"max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == base, r.text


def test_a_content_length_with_many_leading_zeros_is_read_as_its_value(srv):
    body = json.dumps({"prompt": "The cat", "max_tokens": 1}).encode()
    head = _raw(srv, b"POST /v1/completions HTTP/1.0\r\nContent-Length: " + b"0" * 50 + str(len(body)).encode()
                + b"\r\n\r\n" + body)
    assert head.startswith(b"HTTP/1.0 200 "), head[:200]


def test_without_max_tokens_the_answer_fits_what_the_context_leaves(shipped):
    """OpenAI's default of 16 new tokens, cut to the context: a server capped at 8 tokens still answers a
    3-token prompt that names no max_tokens, and refuses only what cannot fit."""
    model, tok = shipped
    with S.CompletionServer(model, tok, "int8", name="tiny", max_context=8).start() as small:
        r = _post(small, {"prompt": [5, 6, 7]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5, r.text
        assert _post(small, {"prompt": [5, 6, 7], "max_tokens": 6}).status_code == 400
        full = _post(small, {"prompt": list(range(5, 13))})  # 8 tokens leave no room to answer
        assert full.status_code == 400 and "max_tokens" not in full.json()["error"]["message"]  # none was sent
        assert "leaves no room for an answer" in full.json()["error"]["message"]


@pytest.mark.parametrize("mode,echo", [("full", False), ("cached", False), ("full", True), ("cached", True)])
def test_a_long_prompt_is_prefilled_in_chunks_that_a_stop_can_end(shipped, monkeypatch, mode, echo):
    """Between two chunks of the prompt the server checks whether to stop: a client gone (or a shutdown)
    ends a long prefill there, not after the whole prompt has run."""
    model, tok = shipped
    monkeypatch.setattr(S, "PREFILL_CHUNK", 4)
    s = S.CompletionServer(model, tok, "int8", name="tiny", max_context=256, prefill_mode=mode)
    try:
        calls = []
        real = model.forward
        monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
        with pytest.raises(S.ClientGone):
            s.complete({"prompt": list(range(5, 25)), "max_tokens": 3, "echo": echo}, gone=lambda: bool(calls))
        assert len(calls) == 1  # the first chunk of five ran; the check before the second stopped it
        monkeypatch.setattr(model, "forward", real)
        whole = s.complete({"prompt": list(range(5, 25)), "max_tokens": 3, "echo": echo, "logprobs": 0})
        assert whole["usage"] == {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}
        if echo:  # chunked, the prompt's log-probabilities are those of one forward
            monkeypatch.setattr(S, "PREFILL_CHUNK", 8192)
            one = s.complete({"prompt": list(range(5, 25)), "max_tokens": 3, "echo": True, "logprobs": 0})
            got, want = whole["choices"][0]["logprobs"], one["choices"][0]["logprobs"]
            assert got["tokens"] == want["tokens"]
            assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-4)
    finally:
        s.httpd.server_close()


def test_an_integer_too_long_to_convert_is_named_by_its_field(srv):
    huge = "9" * 5000
    for field, lo in (("max_tokens", "must be an integer in"), ("temperature", "must be a number in")):
        r = _post(srv, raw=f'{{"prompt": "hi", "{field}": {huge}}}'.encode())
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"'{field}' {lo}"), r.text
        assert r.json()["error"]["message"].endswith("got an integer of 5000 digits")
    r = _post(srv, raw=f'{{"prompt": [1, {huge}]}}'.encode())
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("'prompt' must be")


def test_tokenize_names_the_field_it_was_given_and_takes_a_null_model(srv):
    r = _post(srv, {"content": "a" * (srv.max_prompt_chars + 1)}, path="/tokenize")
    assert r.status_code == 413 and "'content' has" in r.json()["error"]["message"]
    assert _post(srv, {"content": "hi", "model": None}, path="/tokenize").json()["count"] >= 1  # as completions


def test_a_key_given_twice_is_refused(srv):
    r = _post(srv, raw=b'{"prompt": "hi", "prompt": [1], "max_tokens": 1}')
    assert r.status_code == 400 and "'prompt' appears twice" in r.json()["error"]["message"]


def test_a_query_string_does_not_change_the_route(srv):
    assert httpx.get(srv.url + "/health?probe=1", timeout=30).json() == {"status": "ok"}
    assert httpx.get(srv.url + "/v1/models?x", timeout=30).json()["data"][0]["id"] == "tiny"
    assert _post(srv, {"prompt": "hi", "max_tokens": 1}, path="/v1/completions?trace=1").status_code == 200
    assert httpx.get(srv.url + "/nope?x=1", timeout=30).status_code == 404


def test_a_405_names_the_methods_that_work(srv):
    for method in ("PUT", "HEAD"):
        r = httpx.request(method, srv.url + "/health", timeout=30)
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST"

