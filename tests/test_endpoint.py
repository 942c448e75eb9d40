"""The endpoint ladder against real HTTP servers on loopback: kvlab's own model server, and stubs that fail."""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab import endpoint as E
from kvlab.cli import main

# --------------------------------------------------------------------------- stub servers


def _completion(text="12345."):
    return {"choices": [{"text": text, "logprobs": {
        "tokens": list(text), "token_logprobs": [-0.1] * len(text),
        "top_logprobs": [{c: -0.1, "x": -2.5} for c in text]}}], "usage": {"prompt_tokens": 3}}


class Stub:
    """A loopback HTTP server whose POST answers come from ``behave(count) -> (status, body | None)``.

    ``body=None`` stalls (never answers) until the server closes.
    """

    def __init__(self, behave, models=("stub",)):
        self.count, self.stop = 0, threading.Event()
        stub = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, status, body):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(200, {"data": [{"id": m} for m in models]})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.count += 1
                status, body = behave(stub.count)
                if body is None:
                    stub.stop.wait(30)
                    return
                self._answer(status, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()  # quick to shut down

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub():
    made = []

    def make(behave, **kw):
        s = Stub(behave, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the client


def test_retries_500s_then_succeeds(stub):
    s = stub(lambda n: (500, {"error": {"message": "busy"}}) if n <= 2 else (200, _completion()))
    ep = E.Endpoint(s.url, model="stub", retries=3, backoff=0.01)
    assert ep.complete("hi", logprobs=2)["text"] == "12345."
    assert s.count == 3


def test_429_and_5xx_give_up_with_the_last_error(stub):
    s = stub(lambda n: (429, {"error": {"message": "rate limited"}}))
    t0 = time.perf_counter()
    with pytest.raises(E.EndpointError, match=r"gave up after 3 tries.*HTTP 429: rate limited"):
        E.Endpoint(s.url, model="stub", retries=2, backoff=0.01).complete("hi")
    assert s.count == 3 and time.perf_counter() - t0 < 5


@pytest.mark.slow  # waits out a timeout: make test, not make quick
def test_a_stalled_server_times_out_never_hangs(stub):
    s = stub(lambda n: (200, None))
    t0 = time.perf_counter()
    with pytest.raises(E.EndpointError, match=r"no answer within 0.3 s"):
        E.Endpoint(s.url, model="stub", timeout=0.3, retries=1, backoff=0.01).complete("hi")
    assert time.perf_counter() - t0 < 5 and s.count == 2


def test_clear_errors_for_bad_answers(stub):
    bad = stub(lambda n: (200, b"<html>not json</html>"))
    with pytest.raises(E.EndpointError, match="not JSON"):
        E.Endpoint(bad.url, model="stub").complete("hi")
    shape = stub(lambda n: (200, {"id": "x"}))
    with pytest.raises(E.EndpointError, match="malformed answer"):
        E.Endpoint(shape.url, model="stub").complete("hi")
    nolp = stub(lambda n: (200, {"choices": [{"text": "1", "logprobs": None}]}))
    with pytest.raises(E.EndpointError, match="returned no logprobs"):
        E.Endpoint(nolp.url, model="stub").complete("hi", logprobs=5)
    refused = stub(lambda n: (404, {"error": {"message": "model 'x' does not exist"}}))
    with pytest.raises(E.EndpointError, match="HTTP 404: model 'x' does not exist"):
        E.Endpoint(refused.url, model="stub", retries=3).complete("hi")
    assert refused.count == 1, "a 4xx is the caller's mistake: no retries"


def test_unreachable_server_and_bad_urls():
    ep = E.Endpoint(f"http://127.0.0.1:{_free_port()}", retries=1, backoff=0.01)
    with pytest.raises(E.EndpointError, match="cannot connect"):
        ep.models()
    for url, why in [("localhost:8000", "http://"), ("ftp://x", "http://"), ("http://", "no host"),
                     ("http://h:99999", "Port out of range"), ("http://h/v1?x=1", "query"), ("", "non-empty"),
                     ("http://a\nb", "control characters"), ("http://h:8000/a b", "spaces")]:
        with pytest.raises(ValueError, match=why):
            E.Endpoint(url)
    for kw, why in [({"timeout": 0}, "timeout"), ({"retries": -1}, "retries"), ({"backoff": math.nan}, "backoff")]:
        with pytest.raises(ValueError, match=why):
            E.Endpoint("http://h", **kw)


@given(st.text(max_size=40))
def test_base_url_accepts_or_explains(text):
    try:
        u = E.base_url(text)
    except ValueError as e:
        assert "endpoint URL" in str(e)
    else:
        assert u.startswith(("http://", "https://")) and not u.endswith(("/v1", "/"))


def test_base_url_strips_v1():
    assert E.base_url("http://h:8000/v1/") == E.base_url("http://h:8000") == "http://h:8000"


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.floats(-20, 0), min_size=1),
       st.dictionaries(st.sampled_from("abcdefgh"), st.floats(-20, 0), min_size=1))
def test_topk_kl_is_finite_nonnegative_and_zero_on_itself(t, s):
    kl = E._topk_kl(t, s)
    assert math.isfinite(kl) and kl >= 0
    assert E._topk_kl(t, t) == pytest.approx(0, abs=1e-9)


def test_exact_match():
    assert E.exact_match(" 12345.", "12345") and E.exact_match("12345", "12345")
    assert not E.exact_match(" 123456", "12345") and not E.exact_match(" 1234", "12345")


# --------------------------------------------------------------------------- end to end on loopback


@pytest.fixture(scope="module")
def servers(smollm2):
    """Two real servers of the workbook's model: full precision and INT4 with one scale per tensor."""
    from kvlab.server import CompletionServer

    model, tok = smollm2
    a = CompletionServer(model, tok, "fp32", name="smollm2").start()
    b = CompletionServer(model, tok, "int4_tensor", name="smollm2").start()
    yield a, b
    a.close()
    b.close()


def test_a_side_by_side_gives_the_paired_verdict_per_length_and_pooled():
    def d(n, teacher, student):
        return {"length": n, "teacher_correct": teacher, "student_correct": student}

    # -3 +0 and -4 +0: neither length alone is distinguishable (p = 0.25, 0.125), pooled -7 +0 is worse (p = 0.016)
    ds = [d(512, True, False)] * 3 + [d(4096, True, False)] * 4
    pr = E._paired(ds, [512] * 25 + [4096] * 25)
    assert (pr["512"]["lost"], pr["512"]["gained"], pr["512"]["prompts"]) == (3, 0, 25)
    assert pr["512"]["verdict"] == pr["4096"]["verdict"] == "not distinguishable"
    assert (pr["pooled"]["lost"], pr["pooled"]["prompts"], pr["pooled"]["verdict"]) == (7, 50, "worse")
    pr = E._paired(ds + [d(4096, False, True)], [512] * 25 + [4096] * 25)  # one gain: -7 +1, p = 0.07
    assert pr["pooled"]["gained"] == 1 and pr["pooled"]["verdict"] == "not distinguishable"
    assert E._paired([], []) == {}
    # what each count of prompts could detect: 25 prompts catch a 30-point loss (P(Bin(25, 0.3) >= 6) = 0.81) and no
    # smaller step; 5 prompts can never reach p < 0.05
    assert pr["512"]["detectable_loss"] == 0.3 and E._paired([], [512] * 5)["512"]["detectable_loss"] is None


@pytest.mark.slow
def test_side_by_side_end_to_end(servers, tmp_path, capsys):
    a, b = servers
    out = tmp_path / "side.json"
    args = ["niah", "--endpoint", a.url, "--compare", b.url + "/v1", "--lengths", "256", "--depths", "0.5",
            "--trials", "3", "--max-tokens", "6", "--concurrency", "2", "--out", str(out), "--top-logprobs", "4"]
    assert main(args) == 0, capsys.readouterr().err
    doc = E.load(out)
    res = E.results(doc)
    assert set(res) == {a.url, b.url}
    assert res[a.url].accuracy() == 1.0, "full precision should retrieve every 256-token passkey"
    assert doc["length_check"][a.url] <= 2, "prompts should reach the server at (almost) their intended length"
    assert doc["disagreements"], "INT4 with one scale per tensor should miss some 256-token passkeys fp32 finds"
    ag = doc["agreement"]
    assert ag["prompts"] == 3 and ag["mean_topk_kl"] > 0 and "top-k" in ag["caveat"]
    assert len(doc["disagreements"]) == sum(1 for r in res[b.url].rows for _ in range(r["trials"] - r["correct"]))
    pr = doc["paired"]  # the book's rule on the two servers: every disagreement here is a loss
    assert pr["256"] == pr["pooled"] and pr["256"]["prompts"] == 3 and pr["256"]["lost"] == len(doc["disagreements"])
    printed = capsys.readouterr().out
    assert "Student against teacher, paired" in printed
    assert "detect 80% of the time" in printed and "256 tokens: none (too few prompts)" in printed  # 3 prompts
    journal = tmp_path / "side.requests.jsonl"
    assert len(journal.read_text().splitlines()) == 6
    # an interrupted run resumes: drop one answer, and only that request is sent again
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-1]) + "\n")
    assert main(args) == 0
    assert len(journal.read_text().splitlines()) == 6
    assert E.load(out)["results"] == doc["results"]


class FlakyProxy:
    """Forwards completions to ``target``, but answers every other request with a 503 first."""

    def __init__(self, target: str):
        import httpx

        self.calls = 0
        proxy = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *x):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, httpx.get(target + self.path, timeout=30).json())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                proxy.calls += 1
                if proxy.calls % 2:
                    return self._send(503, {"error": {"message": "overloaded"}})
                self._send(200, httpx.post(target + self.path, json=body, timeout=60).json())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()  # quick to shut down

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.slow
def test_side_by_side_through_a_flaky_proxy_and_a_stalled_server(servers, stub, tmp_path, capsys):
    proxy, stall = FlakyProxy(servers[0].url), stub(lambda n: (200, None), models=["smollm2"])
    out = tmp_path / "flaky.json"
    t0 = time.perf_counter()
    try:
        rc = main(["niah", "--endpoint", proxy.url, "--compare", stall.url, "--endpoint-model", "smollm2",
                   "--lengths", "200", "--depths", "1", "--trials", "2", "--max-tokens", "6", "--concurrency", "1",
                   "--timeout", "5", "--retries", "1", "--backoff", "0.1", "--top-logprobs", "0", "--out", str(out)])
    finally:
        proxy.close()
    assert time.perf_counter() - t0 < 120, "a stalled server must time out, not hang the run"
    assert rc == 1, "failed requests make the run exit 1"
    assert "2 requests failed after their retries" in capsys.readouterr().out
    doc = E.load(out)
    assert E.results(doc)[proxy.url].accuracy() == 1.0, "every request through the flaky proxy succeeds on its retry"
    assert proxy.calls == 4, "each of the two prompts: one 503, one retry that goes through"
    assert len(doc["errors"][stall.url]) == 2
    assert all("no answer within 5 s" in e["error"] for e in doc["errors"][stall.url])


def test_cli_niah_endpoint_errors(capsys, tmp_path):
    port = _free_port()
    assert main(["niah", "--endpoint", f"http://127.0.0.1:{port}", "--retries", "0", "--model", "kvlab-tiny",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "cannot connect" in capsys.readouterr().err
    assert main(["niah", "--endpoint", "localhost:1", "--model", "kvlab-tiny"]) == 2
    assert "http://" in capsys.readouterr().err
    assert main(["niah", "--compare", "http://h"]) == 2
    assert "--compare is for a run against a server: it needs --endpoint" in capsys.readouterr().err
    assert main(["niah", "--endpoint", "http://h", "--kv-format", "int4"]) == 2
    assert "server's flag decides" in capsys.readouterr().err
    assert main(["niah"]) == 2
    assert "--kv-format is required" in capsys.readouterr().err


def test_server_rejects_bad_requests(servers):
    import httpx

    a, _ = servers
    for body, why in [({"prompt": "x", "temperature": 0.7}, "greedily"), ({"prompt": ""}, "empty"),
                      ({"prompt": 3}, "'prompt' must be"), ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
                      ({"prompt": "x", "logprobs": 99}, "logprobs"), ({"prompt": "x", "model": "gpt"}, "does not exist"),
                      ({"prompt": [10**9]}, "token ids"), ({"prompt": "x", "stream": True}, "stream"),
                      ({"prompt": "x", "n": 2}, "'n' must be an integer in [1, 1]"), ({"prompt": "x", "best_of": 3}, "best_of")]:
        r = httpx.post(a.url + "/v1/completions", json=body, timeout=30)
        assert 400 <= r.status_code < 500 and why in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(a.url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    assert httpx.get(a.url + "/nope", timeout=30).status_code == 404
    tok = httpx.post(a.url + "/tokenize", json={"content": "hello world"}, timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) > 0


def test_echo_logprobs_and_perplexity(servers, smollm2):
    a, b = servers
    model, tok = smollm2
    ep = E.Endpoint(a.url)
    assert ep.resolve_model() == "smollm2"
    out = ep.complete("The capital of France is", max_tokens=2, logprobs=3, echo=True)
    n = out["prompt_tokens"]
    assert out["token_logprobs"][0] is None and len(out["token_logprobs"]) == n + len(out["top_logprobs"]) - n
    assert all(x <= 0 for x in out["token_logprobs"][1:])
    ppl = E.perplexity(ep, tok, window=128, max_windows=1)
    assert 1 < ppl < 200 and math.isfinite(ppl)
    # the default server lets the prompt attend in full precision: the rung cannot see the KV format
    assert E.perplexity(E.Endpoint(b.url), tok, window=128, max_windows=1) == pytest.approx(ppl, rel=1e-4)


# --------------------------------------------------------------------------- hostile servers, Ctrl-C, the journal

def _prompts(n=8):
    return [E.Prompt("passkey", 100, 0.5, i, f"prompt {i}", "12345") for i in range(n)]


@pytest.mark.slow  # seconds of waiting: in make test, not make quick
def test_ctrl_c_stops_sending_keeps_every_answer_and_says_how_to_resume(stub, tmp_path, capsys):
    import _thread

    s = stub(lambda n: (time.sleep(0.3), (200, _completion()))[1])
    journal = tmp_path / "j.jsonl"
    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(E.Interrupted) as e:
        E.run_ladder([E.Endpoint(s.url)], _prompts(20), journal, concurrency=2, progress=False)
    lines = journal.read_text().splitlines()
    assert e.value.kept == len(lines) == s.count and 1 <= s.count < 20  # nothing sent that was not kept
    assert "run the same command again" in str(e.value) and e.value.left == 20 - len(lines)
    assert re.search(r"waiting for [12] request\(s\) in flight", capsys.readouterr().err)  # why it has not exited yet
    recs = E.run_ladder([E.Endpoint(s.url)], _prompts(20), journal, concurrency=2, progress=False)
    assert len(recs) == 20 and s.count == 20  # the resume asked only for the rest


def test_a_journal_from_other_settings_is_refused_not_reused(stub, tmp_path):
    s = stub(lambda n: (200, _completion()))
    journal = tmp_path / "j.jsonl"
    E.run_ladder([E.Endpoint(s.url)], _prompts(2), journal, max_tokens=12, progress=False)
    with pytest.raises(ValueError, match="max_tokens"):
        E.run_ladder([E.Endpoint(s.url)], _prompts(2), journal, max_tokens=6, progress=False)
    with pytest.raises(ValueError, match="top_logprobs"):
        E.run_ladder([E.Endpoint(s.url)], _prompts(2), journal, top_logprobs=3, progress=False)
    other = stub(lambda n: (200, _completion()), models=("another-model",))
    rec = json.loads(journal.read_text().splitlines()[0])
    journal.write_text(json.dumps(rec | {"endpoint": other.url}) + "\n")  # the same URL now serves another model
    with pytest.raises(ValueError, match="another-model"):
        E.run_ladder([E.Endpoint(other.url)], _prompts(2), journal, progress=False)


def test_a_result_names_the_servers_kv_format_not_its_url(stub, tmp_path):
    s = stub(lambda n: (200, _completion()))
    recs = E.run_ladder([E.Endpoint(s.url)], _prompts(2), tmp_path / "j.jsonl", progress=False)
    r = E.side_by_side(recs, s.url)["results"][E.base_url(s.url)]
    assert r["kv_format"] == "not reported by the server" and r["meta"]["endpoint"] == E.base_url(s.url)
    for rec in recs:
        rec["settings"] = rec["settings"] | {"kv_cache_dtype": "fp8"}  # what vLLM-like servers report
    assert E.side_by_side(recs, s.url)["results"][E.base_url(s.url)]["kv_format"] == "fp8"


def test_answers_without_a_readable_prompt_count_are_counted_and_warned(stub, tmp_path, capsys):
    """One run whose answers carry a NaN, a text, a zero, a negative and no usage count at all: none is a length the
    check can use, so all five are counted as unchecked and the CLI says so."""
    usages = [{"prompt_tokens": float("nan")}, {"prompt_tokens": "3"}, {"prompt_tokens": 0}, {"prompt_tokens": -1}, None]

    def behave(n):
        body = json.loads(json.dumps(_completion()))
        body["usage"] = usages[(n - 1) % len(usages)]
        return 200, json.dumps(body, allow_nan=True).encode()

    s = stub(behave)
    out = tmp_path / "r.json"
    main(["niah", "--endpoint", s.url, "--model", "kvlab-tiny", "--lengths", "128", "--depths", "0.5", "--trials", "5", "--max-tokens", "4",
          "--out", str(out), "--top-logprobs", "0", "--concurrency", "1"])
    doc = E.load(out)
    assert doc["length_unchecked"][E.base_url(s.url)] == 5 and doc["length_check"][E.base_url(s.url)] is None
    assert "gave no readable usage.prompt_tokens for 5 answer(s)" in capsys.readouterr().err


def test_the_table_keeps_every_length_asked_when_requests_fail(stub, tmp_path):
    """A length whose every request failed stays a column ("—"), the failures are counted under the table, and a
    run where nothing was answered is still a well-formed table."""
    s = stub(lambda n: (200, _completion()) if n == 1 else (501, {"error": {"message": "no"}}))
    prompts = [E.Prompt("passkey", 100, 0.5, 0, "p", "12345"), E.Prompt("passkey", 200, 0.5, 0, "q", "12345")]
    recs = E.run_ladder([E.Endpoint(s.url, retries=0)], prompts, tmp_path / "j.jsonl", concurrency=1, progress=False)
    table = E.markdown(E.side_by_side(recs, s.url))
    assert "| endpoint | 100 tokens | 200 tokens |" in table and "| 1/1 | — |" in table
    assert "Failed (after any retries; not counted above): 1 request(s)" in table
    none = E.markdown(E.side_by_side([r | {"error": "HTTP 501"} for r in recs], s.url))
    assert none.splitlines()[:3] == ["| endpoint | 100 tokens | 200 tokens |", "|---|---|---|",
                                     f"| {E.base_url(s.url)} | — | — |"]


def test_a_journal_line_missing_its_answer_is_asked_again(stub, tmp_path):
    s = stub(lambda n: (200, _completion()))
    journal = tmp_path / "j.jsonl"
    E.run_ladder([E.Endpoint(s.url)], _prompts(2), journal, progress=False)
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    del lines[0]["correct"]
    journal.write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"cut\n")
    recs = E.run_ladder([E.Endpoint(s.url)], _prompts(2), journal, progress=False)
    assert s.count == 3 and all(r["correct"] for r in recs)


def test_a_journal_line_with_damaged_cell_fields_is_read_from_its_prompt(stub, tmp_path):
    s = stub(lambda n: (200, _completion()))
    journal = tmp_path / "j.jsonl"
    E.run_ladder([E.Endpoint(s.url)], _prompts(2), journal, progress=False)
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    lines[0]["depth"], lines[1]["length"] = None, "x"
    del lines[1]["trial"]
    journal.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    recs = E.run_ladder([E.Endpoint(s.url)], _prompts(2), journal, progress=False)
    assert s.count == 2  # both reused: the key names the prompt, whose cell is known
    assert [(r["length"], r["depth"], r["trial"]) for r in recs] == [(p.length, p.depth, p.trial) for p in _prompts(2)]


def test_a_resumed_run_grades_each_stored_answer_again_not_its_flag(stub, tmp_path):
    """A journal line saying correct: true over a text without the key is graded from its text (it was trusted)."""
    s = stub(lambda n: (200, _completion()))
    journal = tmp_path / "j.jsonl"
    first = E.run_ladder([E.Endpoint(s.url)], _prompts(2), journal, progress=False)
    assert all(r["correct"] for r in first)
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    damaged = next(x for x in lines if x["key"] == first[0]["key"])  # answers are journaled as they finish
    damaged["text"] = "no key here"  # the flag still says correct
    journal.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    recs = E.run_ladder([E.Endpoint(s.url)], _prompts(2), journal, progress=False)
    assert s.count == 2 and [r["correct"] for r in recs] == [False, True]


def test_a_zero_probability_is_left_out_of_the_kl_and_counted():
    """-Infinity arrives as the floor (-9999): a KL over it is ~9,990 nats of nothing; the token is left out."""
    t = {"tokens": ["a", "b"], "top_logprobs": [{"a": -0.1, "b": -2.4}, {"b": -0.2, "c": -1.7}]}
    s = {"tokens": ["a", "b"], "top_logprobs": [{"a": -0.1, "b": E.LOGPROB_FLOOR}, {"b": -0.3, "c": -1.4}]}
    a = E.agreement(t, s)
    assert a["floored_tokens"] == 1 and a["kl_tokens"] == 1 and a["top1"] == 1.0
    assert 0 <= a["kl"] < 0.1  # the second token only: a small, finite KL
    s["top_logprobs"][1] = {"b": E.LOGPROB_FLOOR, "c": -0.1}
    assert E.agreement(t, s)["kl"] is None  # every token floored: no KL to report, not 9,990 nats


def test_a_server_message_cannot_drive_the_terminal_or_break_the_output(stub):
    s = stub(lambda n: (400, {"error": {"message": "bad \ud800 \x1b[2J\x1b[31mRED\nkvlab: all good"}}))
    with pytest.raises(E.EndpointError) as e:
        E.Endpoint(s.url, model="stub", retries=0).complete("hi")
    msg = str(e.value)
    msg.encode("utf-8")  # no lone surrogate left
    assert "\x1b" not in msg and "\n" not in msg and "\\x1b[2J" in msg and "\\ud800" in msg


def test_a_model_id_that_is_not_printable_text_is_refused(stub):
    s = stub(lambda n: (200, _completion()), models=["\ud800"])
    with pytest.raises(E.EndpointError, match="is not printable text"):
        E.Endpoint(s.url).resolve_model()


@pytest.mark.parametrize("top, lp, ok", [
    ([[{"token": "1", "logprob": -0.1}, {"token": "x", "logprob": -3.0}]], [-0.1], True),  # chat-style lists
    ([{"1": float("-inf")}], [float("-inf")], True),  # a zero probability: floored like vLLM
    ([{"1": float("nan")}], [-0.1], False),
    ([{"1": 0.5}], [-0.1], False),
    ([["1", -0.1]], [-0.1], False),
])
def test_logprob_shapes_and_non_finite_values(stub, top, lp, ok):
    body = json.dumps({"choices": [{"text": "1", "logprobs": {"tokens": ["1"], "token_logprobs": lp,
                                                              "top_logprobs": top}}]}).encode()
    s = stub(lambda n: (200, body))
    ep = E.Endpoint(s.url, retries=0)
    if ok:
        out = ep.complete("p", logprobs=1)
        assert all(math.isfinite(v) for v in out["top_logprobs"][0].values())
        assert all(math.isfinite(v) for v in out["token_logprobs"])
        json.dumps(out, allow_nan=False)
    else:
        with pytest.raises(E.EndpointError, match="log-probabilit|top_logprobs"):
            ep.complete("p", logprobs=1)


def test_cli_warns_when_the_server_counts_other_prompt_lengths(stub, tmp_path, capsys):
    s = stub(lambda n: (200, _completion()))  # answers prompt_tokens=3 for prompts of hundreds of tokens
    out = tmp_path / "o.json"
    rc = main(["niah", "--endpoint", s.url, "--model", "smollm2-135m", "--lengths", "256", "--trials", "1",
               "--out", str(out)])
    assert rc == 0 and "warning" in capsys.readouterr().err


def test_a_result_whose_folder_was_deleted_goes_to_stdout_and_says_the_journal_went_too(stub, tmp_path, capsys,
                                                                                        monkeypatch):
    import shutil

    import kvlab.paths

    s = stub(lambda n: (200, _completion()))
    folder = tmp_path / "d"
    folder.mkdir()
    real = kvlab.paths.write_json

    def after_deleting_the_folder(path, doc):  # the folder goes during the run: journal and all
        shutil.rmtree(folder)
        real(path, doc)

    monkeypatch.setattr(kvlab.paths, "write_json", after_deleting_the_folder)
    rc = main(["niah", "--endpoint", s.url, "--model", "smollm2-135m", "--lengths", "256", "--trials", "1",
               "--out", str(folder / "o.json")])
    cap = capsys.readouterr()
    assert rc == 1 and json.loads(cap.out)["lengths"] == [256]
    assert "is gone too" in cap.err and "stay in" not in cap.err


@pytest.mark.slow  # a subprocess that imports the model stack: 5 s of make quick's minute
def test_ctrl_c_on_the_cli_exits_130_with_one_line(stub, tmp_path):
    import signal
    import subprocess
    import sys

    s = stub(lambda n: (time.sleep(0.2), (200, _completion()))[1])
    p = subprocess.Popen([sys.executable, "-m", "kvlab", "niah", "--endpoint", s.url, "--lengths", "256,512",
                          "--trials", "5", "--concurrency", "1", "--out", str(tmp_path / "o.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while s.count < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "run the same command again" in err
    kept = len((tmp_path / "o.requests.jsonl").read_text().splitlines())
    assert kept == s.count  # every request sent was answered and kept


@pytest.mark.parametrize("body, why", [
    ({"choices": [{"text": "1"}], "usage": [1, 2]}, None),  # an unreadable usage: not compared, not a crash
    ({"choices": [{"text": "1", "logprobs": {"tokens": ["1"], "token_logprobs": 5, "top_logprobs": [{"1": -0.1}]}}]},
     "token_logprobs must be a list"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply to read"),
    (b"{not json", "something that is not JSON"),
    (b"null", "JSON that is not an object: null"),
    (b'"\\u001b[2J\\u001b[31mPWNED"', r'not an object: "\\u001b\[2J'),  # a terminal's escapes shown, not sent
    (b'"\\u009b2J"', r'not an object: "\\x9b2J'),  # a C1 control json.dumps leaves as it is: escaped by _printable
    (b'{"choices": [{"text": "1"}], "usage": {"prompt_tokens": NaN}}', None),
])
def test_malformed_answers_are_errors_not_crashes(stub, body, why):
    s = stub(lambda n: (200, body))
    ep = E.Endpoint(s.url, retries=0)
    if why is None:
        out = ep.complete("p", logprobs=None)
        assert out["prompt_tokens"] is None
    else:
        with pytest.raises(E.EndpointError, match=why):
            ep.complete("p", logprobs=1)


def _gives_up_in_time(url: str, timeout: float) -> None:
    """One request to a server that never finishes its answer fails with 'no answer within' soon after ``timeout``."""
    ep = E.Endpoint(url, model="m", timeout=timeout, retries=0)
    t0 = time.time()
    with pytest.raises(E.EndpointError, match=f"no answer within {timeout:g} s"):
        ep.complete("p")
    assert time.time() - t0 < timeout + 3.5


@pytest.mark.slow  # seconds: in make test, not make quick
def test_timeout_bounds_the_whole_answer_not_each_read():
    """A server that drips its answer a byte at a time is cut off after --timeout, not after the last byte."""
    class Drip(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            data = json.dumps(_completion()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for b in data:
                try:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    try:
        _gives_up_in_time(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=1.0)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_perplexity_beyond_float_range_is_an_error_and_the_ladder_is_still_written(stub, tmp_path, capsys):
    def behave(n):
        lp = {"tokens": ["a"] * 512, "token_logprobs": [None] + [-9999.0] * 511,
              "top_logprobs": [None] + [{"a": -9999.0}] * 511}
        return 200, {"choices": [{"text": "12345", "logprobs": lp}], "usage": {"prompt_tokens": 512}}

    s = stub(behave)
    ep = E.Endpoint(s.url)
    with pytest.raises(E.EndpointError, match="beyond float range"):
        E.perplexity(ep, _WindowTok(), text="x", window=512, max_windows=1)
    out = tmp_path / "o.json"
    rc = main(["niah", "--endpoint", s.url, "--model", "smollm2-135m", "--lengths", "256", "--trials", "1",
               "--depths", "0.5", "--ppl-windows", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 1 and doc["perplexity"] == {s.url: None} and "beyond float range" in doc["perplexity_errors"][s.url]


def test_lengths_past_the_servers_window_and_bad_outs_are_refused_up_front(stub, tmp_path, capsys):
    s = stub(lambda n: (200, _completion()), models=("m",))
    s.httpd.RequestHandlerClass.do_GET = lambda self: self._answer(200, {"data": [{"id": "m", "max_model_len": 1000}]})
    assert main(["niah", "--endpoint", s.url, "--lengths", "2048", "--out", str(tmp_path / "o.json")]) == 2
    assert "max_model_len of 1000" in capsys.readouterr().err and s.count == 0
    assert main(["niah", "--endpoint", s.url, "--lengths", "256", "--out", "/proc/version"]) == 2
    assert "a process's stream, not a regular file" in capsys.readouterr().err
    assert main(["niah", "--endpoint", s.url, "--lengths", "256", "--out", "/sys/kvlab.json"]) == 2
    assert "cannot create a file" in capsys.readouterr().err  # root may write almost anywhere, not there
    assert main(["niah", "--endpoint", s.url, "--lengths", "256", "--out", " "]) == 2
    with pytest.raises(SystemExit):
        main(["niah", "--endpoint", s.url, "--lengths", "100000000"])


@pytest.mark.parametrize("body", [
    {"choices": [{"text": "1", "logprobs": {"tokens": ["1"], "token_logprobs": [-10**400], "top_logprobs": [{"1": -10**400}]}}]},
])
def test_a_log_probability_too_large_for_a_float_is_floored(stub, body):
    s = stub(lambda n: (200, json.dumps(body).encode()))
    out = E.Endpoint(s.url, retries=0).complete("p", logprobs=1)
    assert out["token_logprobs"] == [E.LOGPROB_FLOOR] and out["top_logprobs"] == [{"1": E.LOGPROB_FLOOR}]


@pytest.mark.slow  # seconds of waiting: in make test, not make quick
def test_headers_dripped_for_ever_are_cut_off_at_the_timeout():
    """A server that sends '100 Continue' every half second, for ever: --timeout bounds the whole request."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            def drip(c=c):
                try:
                    while not stop.is_set():
                        c.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                        time.sleep(0.5)
                except OSError:
                    pass
            threading.Thread(target=drip, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        _gives_up_in_time(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout=1.5)
    finally:
        stop.set()
        srv.close()


def test_bad_urls_timeouts_and_retry_after_values_are_clear_errors(stub):
    for url in ("http://\u0663.com", "http://127.0.0.1:1/x\x7f"):
        with pytest.raises(ValueError, match="not a valid URL|control characters"):
            E.Endpoint(url)
    with pytest.raises(ValueError, match="at most"):
        E.Endpoint("http://127.0.0.1:1", timeout=1e10)
    s = stub(lambda n: (429, {"error": {"message": "slow down"}}))
    s.httpd.RequestHandlerClass._answer_orig = s.httpd.RequestHandlerClass._answer

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Retry-After", "\u00b2")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    s.httpd.RequestHandlerClass._answer = answer
    with pytest.raises(E.EndpointError, match="HTTP 429"):
        E.Endpoint(s.url, model="stub", retries=1, backoff=0).complete("p")


def test_credentials_never_ride_in_the_url():
    with pytest.raises(ValueError, match="credentials") as e:
        E.base_url("http://alice:s3cret@h:8000/v1")
    assert "s3cret" not in str(e.value)
    for bad in ("tok\nX-Evil: 1", "é", 5):
        with pytest.raises(ValueError, match="api_key"):
            E.Endpoint("http://h:8000", api_key=bad)
    assert E.Endpoint("http://h:8000", api_key="sk-abc").api_key == "sk-abc"


@pytest.mark.parametrize("url", ["http://u:SECRETXYZ@127.0.0.1:99999", "ftp://u:SECRETXYZ@h", "http://u:SECRETXYZ@",
                                 "http://u:SECRETXYZ@h/?q=1", "http://u:SECRETXYZ@[::1:8000"])
def test_no_message_repeats_a_password(url):
    with pytest.raises(ValueError) as e:
        E.base_url(url)
    assert "SECRETXYZ" not in str(e.value) and "endpoint URL" in str(e.value)


def test_an_api_key_with_spaces_is_refused_without_echoing_it():
    for key in ("SECRETXYZ ", " SECRETXYZ", "SECRET XYZ", "   "):
        with pytest.raises(ValueError, match="bearer token is one word") as e:
            E.Endpoint("http://h:8000", api_key=key)
        assert "SECRET" not in str(e.value)


def test_compare_is_the_library_call_and_an_interrupted_perplexity_keeps_the_ladder(stub, tmp_path, monkeypatch, shipped):
    """endpoint.compare is what the CLI and scripts/compare_engines.py run: the ladder, side by side, and the
    perplexity rung recorded beside it; Ctrl-C during that rung returns the whole ladder, marked interrupted."""
    s = stub(lambda n: (200, _completion()))
    _, tok = shipped

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(E, "perplexity", ctrl_c)
    doc = E.compare([E.Endpoint(s.url)], tok, tmp_path / "j.jsonl", lengths=[256], depths=[0.5], trials=2,
                    ppl_windows=1, progress=False)
    assert doc["perplexity"] == {s.url: None} and doc["perplexity_errors"] == {s.url: "interrupted"}
    assert sum(r["trials"] for r in doc["results"][s.url]["rows"]) == 2


def test_redirects_501_and_html_error_pages_are_one_clear_line(stub):
    """A redirect is named, not followed; 501 (never going to work) is not retried; an HTML error page is
    reduced to its title, not twelve lines of markup."""
    html = b"<html><head><title>Error response</title></head><body><h1>Error</h1><p>" + b"x" * 2000 + b"</p></body></html>"
    page = stub(lambda n: (404, html))
    with pytest.raises(E.EndpointError) as e:
        E.Endpoint(page.url, model="stub").complete("hi")
    assert str(e.value).endswith("HTTP 404: Error response") and "<" not in str(e.value)
    never = stub(lambda n: (501, {"error": {"message": "not implemented"}}))
    with pytest.raises(E.EndpointError, match="HTTP 501: not implemented"):
        E.Endpoint(never.url, model="stub", retries=3, backoff=0.01).complete("hi")
    assert never.count == 1
    moved = stub(lambda n: (302, b""))
    with pytest.raises(E.EndpointError, match="a redirect to .* not followed"):
        E.Endpoint(moved.url, model="stub", retries=0).complete("hi")
    plain = stub(lambda n: (200, _completion()))  # https:// against a plain-HTTP server: one try, one line
    t0 = time.monotonic()
    with pytest.raises(E.EndpointError, match="TLS handshake failed .* use http://"):
        E.Endpoint(plain.url.replace("http://", "https://"), model="stub", retries=3, backoff=1.0).complete("hi")
    assert time.monotonic() - t0 < 1.0  # not three back-offs (1 + 2 + 4 s)


@given(st.text(alphabet=st.characters(blacklist_characters="/\r\n\t ", blacklist_categories=("Cs", "Cc")),
               min_size=1, max_size=20))
def test_no_part_of_a_password_reaches_a_message(secret):
    """Credentials are refused, and the message masks everything up to the host, '@' in the password included."""
    url = f"http://user:Zq{secret}Zq@hunter@127.0.0.1:1"
    with pytest.raises(ValueError) as e:
        E.Endpoint(url)
    assert "hunter" not in str(e.value) and f"Zq{secret}Zq" not in str(e.value) and "***@127.0.0.1:1" in str(e.value)


def test_an_endpoint_that_changes_model_between_answers_is_caught(stub):
    """Behind a load balancer mid-redeploy the same URL can answer as another model: that answer is an error."""
    s = stub(lambda n: (200, _completion() | {"model": "fake" if n % 2 else "other"}))
    ep = E.Endpoint(s.url, model="stub", retries=0)
    assert ep.complete("hi")["text"] == "12345."
    with pytest.raises(E.EndpointError, match="answered as model 'other' where earlier answers said 'fake'"):
        ep.complete("hi")


def test_a_log_probability_within_rounding_of_zero_is_written_as_zero():
    assert E._finite_logprob(1e-7, "w") == 0.0 and E._finite_logprob(-0.5, "w") == -0.5
    with pytest.raises(E.EndpointError, match="<= 0"):
        E._finite_logprob(0.01, "w")


def test_a_journal_that_cannot_be_written_says_which_file_and_how_to_resume(stub, tmp_path, monkeypatch):
    import io

    s = stub(lambda n: (200, _completion()))
    journal = tmp_path / "full.requests.jsonl"
    real_open = Path.open

    class Full(io.StringIO):  # a disk that fills up at the first answer
        def write(self, text):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "open", lambda self, *a, **k: Full() if self == journal else real_open(self, *a, **k))
    with pytest.raises(ValueError, match=r"full.requests.jsonl: No space left on device; the 0 answers written "
                                         "before are kept .* run the same command to resume"):
        E.run_ladder([E.Endpoint(s.url, model="stub", retries=0)], _prompts(2), journal, top_logprobs=0)


def test_a_log_probability_of_thousands_of_digits_is_out_of_range_not_not_json(stub):
    huge = _completion()
    body = json.dumps(huge).replace("-0.1", "-" + "9" * 5000, 1).encode()
    doc = E._json_or_none(body)
    assert doc is not None and doc["choices"][0]["logprobs"]["token_logprobs"][0] == float("-inf")
    assert E._finite_logprob(doc["choices"][0]["logprobs"]["token_logprobs"][0], "w") == E.LOGPROB_FLOOR
    assert E._json_or_none(b'{"a": ' + b"9" * 5000 + b"}")["a"] == float("inf")


def test_a_resumed_run_holds_the_server_to_the_model_its_journal_answers_named(stub, tmp_path):
    who = {"name": "fake"}
    s = stub(lambda n: (200, _completion() | {"model": who["name"]}))
    journal = tmp_path / "r.requests.jsonl"
    first = E.run_ladder([E.Endpoint(s.url, model="stub", retries=0)], _prompts(1), journal, top_logprobs=0)
    assert first[0]["answered_as"] == "fake" and first[0]["error"] is None
    who["name"] = "fake-v2"  # redeployed between the two runs
    again = E.run_ladder([E.Endpoint(s.url, model="stub", retries=0)], _prompts(2), journal, top_logprobs=0)
    assert again[0]["answered_as"] == "fake" and "answered as model 'fake-v2'" in again[1]["error"]


def test_a_journal_that_is_a_link_or_another_file_is_refused_and_a_cut_line_is_ended(stub, tmp_path):
    s = stub(lambda n: (200, _completion()))
    other = tmp_path / "precious.txt"
    other.write_text("precious\n")
    link = tmp_path / "l.requests.jsonl"
    link.symlink_to(other)
    with pytest.raises(ValueError, match="is a symbolic link"):
        E.run_ladder([E.Endpoint(s.url, model="stub", retries=0)], _prompts(1), link, top_logprobs=0)
    foreign = tmp_path / "f.requests.jsonl"
    foreign.write_text("precious\n")
    with pytest.raises(ValueError, match="first line is not an answer this command wrote"):
        E.run_ladder([E.Endpoint(s.url, model="stub", retries=0)], _prompts(1), foreign, top_logprobs=0)
    assert other.read_text() == foreign.read_text() == "precious\n"
    journal = tmp_path / "c.requests.jsonl"
    E.run_ladder([E.Endpoint(s.url, model="stub", retries=0)], _prompts(1), journal, top_logprobs=0)
    journal.write_text(journal.read_text() + '{"endpoint": "cut sho')  # a run killed mid-write
    E.run_ladder([E.Endpoint(s.url, model="stub", retries=0)], _prompts(2), journal, top_logprobs=0)
    lines = journal.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["key"] and lines[1] == '{"endpoint": "cut sho'


class _WindowTok:
    """A tokenizer stand-in for the perplexity rung: 600 tokens of any text, decoded as one character each."""

    def encode(self, text, add_special_tokens=False):
        return list(range(600))

    def decode(self, ids):
        return "x" * len(ids)


@pytest.mark.parametrize("returned, claimed", [(3, 512), (10, 11)])
def test_perplexity_needs_a_log_probability_for_every_token_of_the_window_sent(stub, returned, claimed):
    """A server that echoes 2 prompt log-probabilities for a 512-token window gets no perplexity, whether it counts
    the prompt honestly (512) or claims a count that matches what it returned (11)."""
    def behave(n):
        lp = {"tokens": ["a"] * returned, "token_logprobs": [None] + [-1.0] * (returned - 1),
              "top_logprobs": [None] + [{"a": -1.0}] * (returned - 1)}
        return 200, {"choices": [{"text": "12345", "logprobs": lp}], "usage": {"prompt_tokens": claimed}}

    with pytest.raises(E.EndpointError, match=f"returned {returned - 1} prompt log-probabilities for a prompt of 512 tokens"):
        E.perplexity(E.Endpoint(stub(behave).url), _WindowTok(), text="x", window=512, max_windows=1)


def test_a_haystack_file_goes_to_the_servers_and_is_never_overwritten(stub, tmp_path, capsys, monkeypatch):
    """--haystack-file with --endpoint: the passkey's haystack is cut from your own text (the settings say "text");
    --out naming the haystack file is refused before any request."""
    from kvlab.models import load_tokenizer

    text = "Our support desk answers questions about invoices, refunds and delivery dates. " * 120
    tok = load_tokenizer("kvlab-tiny")
    prompts = E.ladder_prompts(tok, lengths=[128], depths=[0.5], trials=2, haystack_text=text)
    assert len(prompts) == 2 and all("invoices" in p.text for p in prompts)
    assert prompts[0].text != E.ladder_prompts(tok, lengths=[128], depths=[0.5], trials=2)[0].text
    with pytest.raises(ValueError, match="passkey task"):
        E.ladder_prompts(tok, task="chain", lengths=[128], depths=[0.5], haystack_text=text)
    # only the file's start is read (64 characters a token of the longest prompt): what follows changes nothing
    from kvlab.evals import HAYSTACK_CHARS

    assert len(text) > HAYSTACK_CHARS * 128
    assert [p.text for p in prompts] == [p.text for p in E.ladder_prompts(tok, lengths=[128], depths=[0.5], trials=2,
                                                                         haystack_text=text + "tail " * 10**6)]
    hay = tmp_path / "traffic.txt"
    hay.write_text(text)
    s = stub(lambda n: (200, _completion()))
    out = tmp_path / "r.json"
    argv = ["niah", "--endpoint", s.url, "--model", "kvlab-tiny", "--lengths", "128", "--depths", "0.5", "--trials", "2",
            "--max-tokens", "4", "--top-logprobs", "0", "--concurrency", "1", "--haystack-file", str(hay)]
    assert main(argv + ["--out", str(out)]) == 0
    settings = E.load(out)["settings"]
    assert settings["haystack"] == "text" and settings["haystack_file"] == str(hay)
    import hashlib

    assert settings["haystack_sha256"] == hashlib.sha256(text.encode()).hexdigest()  # which text, exactly
    capsys.readouterr()
    assert main(argv + ["--out", str(hay)]) == 2 and s.count == 2  # refused before any request
    assert "would overwrite --haystack-file" in capsys.readouterr().err and hay.read_text() == text
    # without --out the result goes to kvlab-endpoints.json: a haystack of that name is refused too
    monkeypatch.chdir(tmp_path)
    default = tmp_path / "kvlab-endpoints.json"
    default.write_text(text)
    assert main([*argv[:-1], "kvlab-endpoints.json"]) == 2 and default.read_text() == text and s.count == 2
    assert main(argv + ["--haystack", "prose", "--out", str(out)]) == 2
    assert "not both" in capsys.readouterr().err
