import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import cli
from kvlab.cli import main


def test_json_output(capsys):
    assert main(["budget", "--model", "llama-3.1-8b", "--batch", "2", "--context", "1000", "--kv-dtype", "int4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 32 * 2 * 8 * 128 * 9 // 16
    assert out["block_size"] == 16 and out["cache_bytes"] == 2 * 1008 * out["bytes_per_token"]  # 63 whole blocks
    assert isinstance(out["cache_bytes"], int) and isinstance(out["bytes_per_token"], int)


def test_gpu_fields(capsys):
    assert main(["budget", "--model", "llama-3.1-70b", "--batch", "100", "--context", "32768", "--kv-dtype", "fp8",
                 "--gpu", "H200", "--weights-dtype", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["max_concurrency"] >= 1


def test_table_output(capsys):
    assert main(["budget", "--model", "qwen2.5-7b", "--batch", "1", "--context", "10"]) == 0
    assert "bytes_per_token" in capsys.readouterr().out


def run(argv):
    """main()'s exit status, whether argparse exits or main returns."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("argv,needle", [
    (["--model", "nope"], "neither a preset"),
    (["--kv-dtype", "int3"], "unknown KV format"),
    (["--batch", "0"], "argument --batch: must be >= 1"),
    (["--context", "-4"], "argument --context: must be >= 1"),
    (["--context", "0"], "argument --context: must be >= 1"),
    (["--batch", "9" * 20], "argument --batch: must be <="),
    (["--batch", "two"], "argument --batch: must be an integer"),
    (["--gpu", "TPU"], "unknown GPU"),
    (["--tp", "3"], "--tp 3 must divide"),
    (["--memory-utilization", "1.5"], "must be in (0, 1]"),
])
def test_errors_are_one_clear_line(argv, needle, capsys):
    base = {"--model": "llama-3.1-70b", "--batch": "1", "--context": "100"}
    args = ["budget"] + [x for k, v in base.items() if k not in argv for x in (k, v)] + argv
    assert run(args) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_unreadable_config_path(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text("[]")
    assert main(["budget", "--model", str(p), "--batch", "1", "--context", "1"]) == 2
    assert "JSON object" in capsys.readouterr().err


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "kvlab", "formats", "--json"], capture_output=True, text=True)
    assert r.returncode == 0
    names = [row["name"] for row in json.loads(r.stdout)]
    assert {"fp8_e4m3", "int4", "q4_0", "kivi-2"} <= set(names)


def test_niah_checks_out_before_running(tmp_path, capsys):
    from kvlab.cli import main

    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "no" / "r.json", "does not exist")):
        assert main(["niah", "--kv-format", "int4", "--model", "kvlab-tiny", "--out", str(bad)]) == 2
        assert why in capsys.readouterr().err


def test_niah_prose_haystack_runs_and_saves(tmp_path, capsys):
    import json

    from kvlab.cli import main

    out = tmp_path / "r.json"
    assert main(["niah", "--kv-format", "int8", "--model", "kvlab-tiny", "--lengths", "256", "--depths", "0.5",
                 "--trials", "2", "--haystack", "prose", "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["meta"]["haystack"] == "prose" and doc["meta"]["prefill"] == "full"
    assert json.loads(out.read_text())["rows"][0]["trials"] == 2 and not list(tmp_path.glob("*.tmp"))


def test_niah_haystack_file_and_chunked_prefill(tmp_path, capsys):
    """A user's own text as the haystack, prefilled in chunks: the prompt is cut from that file."""
    import json

    from kvlab.cli import main

    text = tmp_path / "mine.txt"
    text.write_text("Our service answered the call. The queue drained slowly. " * 200)
    assert main(["niah", "--kv-format", "int8", "--model", "kvlab-tiny", "--lengths", "256", "--depths", "0.5",
                 "--trials", "2", "--haystack-file", str(text), "--chunk", "64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["meta"]["haystack"] == "text" and doc["rows"][0]["trials"] == 2
    for bad, why in ((tmp_path / "missing.txt", "no such file"), (tmp_path, "is a folder, not a file")):
        assert main(["niah", "--kv-format", "int8", "--model", "kvlab-tiny", "--lengths", "256",
                     "--haystack-file", str(bad)]) == 2
        assert why in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    assert main(["niah", "--kv-format", "int8", "--model", "kvlab-tiny", "--lengths", "256",
                 "--haystack-file", str(short)]) == 2
    assert "fewer than the longest length" in capsys.readouterr().err


def test_niah_refuses_lengths_past_the_models_window(capsys):
    from kvlab.cli import main

    assert main(["niah", "--kv-format", "int8", "--model", "kvlab-tiny", "--lengths", "100000"]) == 2
    assert "past the model's" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--lengths", "1"], "too short for a passkey prompt"),
    (["--task", "chain", "--hops", "50", "--lengths", "64"], "too short for a 50-hop chain"),
])
def test_niah_refuses_a_length_its_task_cannot_use_before_the_model_loads(monkeypatch, capsys, argv, needle):
    import kvlab.models
    from kvlab.cli import main

    monkeypatch.setattr(kvlab.models, "load_model", lambda *a, **k: pytest.fail("niah loaded the model first"))
    assert main(["niah", "--kv-format", "int8", "--model", "kvlab-tiny", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["budget", "--model", "CONFIG", "--batch", "1", "--context", "8", "--gpu", "H100-80GB"], "num_key_value_heads must be > 0"),
    (["budget", "--model", "llama-3.1-8b", "--batch", "1", "--context", "8", "--gpu", "H100-80GB", "--tp", "64"],
     "must divide the model's 32 attention heads"),
    (["serve-sim", "--trace", ""], "trace path is empty"),
    (["serve-sim", "--trace", "TMP"], "is a directory"),
    (["serve-sim", "--trace", "NAN"], "NaN is not a number JSON allows"),
    (["serve-sim", "--trace", "GOOD", "--block-size", "16"], "is block_size right"),
    (["serve-sim", "--model", "CONFIG", "--workload", "rag"], "num_key_value_heads must be > 0"),
])
def test_bad_files_and_values_exit_2_with_one_line(argv, needle, tmp_path, capsys):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": -1,
                               "hidden_size": 256}))
    (tmp_path / "nan.jsonl").write_text('{"timestamp": NaN, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n')
    (tmp_path / "good.jsonl").write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n')
    subst = {"CONFIG": str(cfg), "TMP": str(tmp_path), "NAN": str(tmp_path / "nan.jsonl"),
             "GOOD": str(tmp_path / "good.jsonl")}
    assert main([subst.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_formats_engines_names_every_preset_and_cites_every_engine(capsys):
    import json

    from kvlab.formats import engine_nearest, engine_options, engine_table, format_names, get_format

    t = engine_table()
    presets = [n for n in format_names()]
    assert set(t["presets"]) == set(presets), "every preset needs a row in data/presets/engines.json"
    for row in t["presets"].values():
        assert set(row) == set(t["engines"])
    assert all(len(e["source"]) > 40 for e in t["engines"].values()), "every engine cites its documentation"
    assert engine_options("fp8")["vLLM"].startswith("--kv-cache-dtype fp8")
    assert engine_options("q4_0")["llama.cpp"].startswith("-ctk q4_0 -ctv q4_0 -fa on (llama.cpp rotates first by default")
    assert "LLAMA_ATTN_ROT_DISABLE=1 reproduces" in engine_options("q4_0")["llama.cpp"]
    assert "llama.cpp" in engine_nearest("q4_0+rotate")  # llama.cpp's default rotates a quantized cache
    assert engine_options("kivi-2")["vLLM"] is None
    assert engine_options("int8")["vLLM"].startswith("--kv-cache-dtype int8_per_token_head")  # vLLM 0.21+, Triton
    for fmt, opts in t["nearest"].items():  # near-matches: a kvlab format, known engines, each saying how it differs
        get_format(fmt)
        assert set(opts) <= set(t["engines"]) and all("not exact" in v or "differ" in v for v in opts.values())
    assert "vLLM" in engine_nearest("int4_token+rotate") and engine_nearest("int4") == {}
    assert main(["formats", "--engines"]) == 0
    out = capsys.readouterr().out
    assert "lmdeploy-int4" in out and "--quant-policy 4" in out and "sources:" in out
    assert "int4_token+rotate (no preset; the nearest engine options)" in out and "int4_per_token_head" in out
    assert main(["formats", "--engines", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["presets"]["fp8_e5m2"]["sglang"] == "--kv-cache-dtype fp8_e5m2"


def test_out_is_refused_before_the_run_when_it_cannot_hold_a_result(tmp_path, capsys):
    """A device file would be replaced by the atomic rename; an unwritable folder would lose the result."""
    import os

    from kvlab.cli import main
    from kvlab.paths import out_problem

    assert out_problem(tmp_path / "ok.json") is None
    assert "not a regular file" in out_problem("/dev/null")
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert "not writable" in out_problem(ro / "r.json")
    assert main(["niah", "--kv-format", "int4", "--model", "kvlab-tiny", "--out", "/dev/null"]) == 2
    assert "not a regular file" in capsys.readouterr().err


def test_read_json_takes_only_an_object_of_the_shape_asked(tmp_path):
    from kvlab.paths import read_json

    f = tmp_path / "r.json"
    f.write_text('{"steps": {}, "n": 1}')
    assert read_json(f, "--out", {"steps": dict, "lengths": list}) == {"steps": {}, "n": 1}  # a key absent is fine
    for text, why in (("not json", "not JSON (Expecting value, line 1)"), ("[1]", "not a result this script wrote"),
                      ('{"steps": []}', "(steps of the wrong type)"), ("", "the file is empty"),
                      ('{"s": NaN}', "(holds NaN, which strict JSON has not)"), ('{"s": -Infinity}', "holds -Infinity"),
                      ("[" * 100_000, "(nested too deeply)"), ('{"n": ' + "9" * 5000 + "}", "a number too long to read")):
        f.write_text(text)
        with pytest.raises(ValueError, match=re.escape(why)) as e:
            read_json(f, "--out", {"steps": dict})
        assert str(e.value).startswith("--out ") and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no such file"):
        read_json(tmp_path / "none.json", "--out", {})


def test_write_json_is_strict_atomic_and_never_replaces_a_device(tmp_path):
    import math

    from kvlab.paths import write_json

    with pytest.raises(ValueError, match="not a regular file"):
        write_json("/dev/null", {"a": 1})
    with pytest.raises(ValueError, match="Out of range float"):
        write_json(tmp_path / "nan.json", {"kl": math.nan})
    assert not list(tmp_path.iterdir())  # no result, and no temporary file left behind
    write_json(tmp_path / "ok.json", {"a": [1, 2.5]})
    assert json.loads((tmp_path / "ok.json").read_text()) == {"a": [1, 2.5]}


def test_work_that_would_never_finish_is_refused_up_front(tmp_path, capsys):
    from kvlab.cli import MAX_REQUESTS

    with pytest.raises(SystemExit) as e:
        main(["serve-sim", "--requests", str(MAX_REQUESTS + 1), "--model", "llama-3.1-8b", "--gpu", "L4"])
    assert e.value.code == 2 and f"<= {MAX_REQUESTS}" in capsys.readouterr().err
    deep = tmp_path / "config.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["budget", "--model", str(deep), "--batch", "1", "--context", "8"]) == 2
    assert "too deeply" in capsys.readouterr().err


def test_a_result_is_never_lost_to_a_full_disk(tmp_path, capsys, monkeypatch):
    """--out on a full disk: one line naming the file, the result on stdout, exit 1; a temporary file is not
    left behind; and a full standard output is one line too, not a traceback."""
    import errno
    import io

    import kvlab.paths

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kvlab.paths.os, "replace", full)
    out = tmp_path / "r.json"
    rc = main(["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--lengths", "64", "--depths", "0.5",
               "--trials", "1", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 1 and "No space left on device" in cap.err and str(out) in cap.err and "Traceback" not in cap.err
    assert json.loads(cap.out)["kv_format"] == "int8" and not list(tmp_path.iterdir())
    monkeypatch.undo()

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["formats"]) == 1
    assert "cannot write the output (No space left on device)" in capsys.readouterr().err

    class Closed(io.StringIO):  # `kvlab formats | head -1`: the reader went away, which is not an error to report
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["formats"]) == 141 and capsys.readouterr().err == ""
    monkeypatch.setattr(sys, "stdout", Full())

    # serve says so before loading its model (it used to fail only after the load, on its first line)
    import kvlab.models
    monkeypatch.setattr(kvlab.models, "load_model", lambda *a: pytest.fail("serve loaded the model first"))
    assert main(["serve", "--model", "kvlab-tiny", "--kv-format", "int8"]) == 1
    assert "cannot write the output (No space left on device)" in capsys.readouterr().err


def test_a_closed_standard_output_is_one_line_not_a_traceback():
    import subprocess

    p = subprocess.run([sys.executable, "-m", "kvlab", "formats"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, preexec_fn=lambda: __import__("os").close(1), timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == "kvlab: error: standard output is closed", p.stderr


def test_a_result_through_a_link_lands_in_its_target_and_streams_are_refused(tmp_path):
    import json as J

    from kvlab.cli import main
    from kvlab.paths import out_problem, write_json

    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("{}")
    link.symlink_to(target)
    write_json(link, {"a": 1})  # the rename goes to the file the link names; the link stays a link
    assert link.is_symlink() and J.loads(target.read_text()) == {"a": 1}
    assert "a device or a process's stream" in out_problem("/dev/stdout")
    (tmp_path / "afile").write_text("x")
    assert "is not a folder" in out_problem(tmp_path / "afile" / "r.json")
    assert main(["niah", "--kv-format", "int8", "--model", "kvlab-tiny", "--out", "/dev/stdout"]) == 2
    (tmp_path / "loop1.json").symlink_to(tmp_path / "loop2.json")
    (tmp_path / "loop2.json").symlink_to(tmp_path / "loop1.json")
    assert "is a loop of symbolic links" in out_problem(tmp_path / "loop1.json")
    (tmp_path / "to-dev.json").symlink_to("/dev/kvlab-nothing-here")  # a link into /dev is refused by its target
    assert "a device or a process's stream" in out_problem(tmp_path / "to-dev.json")
    if Path("/dev/shm").is_dir():  # a tmpfs folder, not a device
        assert "a device" not in (out_problem("/dev/shm/kvlab-probe.json") or "")
    # a link whose target is a run's journal: the result would replace that journal
    (tmp_path / "own.json").symlink_to(tmp_path / "other.requests.jsonl")
    assert main(["niah", "--endpoint", "http://127.0.0.1:1", "--out", str(tmp_path / "own.json")]) == 2


def test_result_files_get_the_usual_mode_not_mkstemps_0600(tmp_path):
    import os
    import stat

    from kvlab.paths import write_json

    old = os.umask(0o022)
    try:
        write_json(tmp_path / "a.json", {"a": 1})
        assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
        (tmp_path / "a.json").chmod(0o640)
        write_json(tmp_path / "a.json", {"a": 2})  # rewriting keeps the file's own mode
        assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    finally:
        os.umask(old)


@pytest.mark.parametrize("argv,needle", [
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--haystack-file", "/dev/zero"], "not a regular file"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--haystack-file", "EMPTY"], "the file is empty"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--trials", "9" * 20], "argument --trials: must be <="),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--task", "chain", "--hops", "200"], "argument --hops: must be <="),
    (["niah", "--endpoint", "http://127.0.0.1:1", "--retries", "1000000"], "argument --retries: must be <="),
    (["serve", "--model", "kvlab-tiny", "--kv-format", "int8", "--host", "999.1.1.1"], "--host '999.1.1.1'"),
    (["serve", "--model", "kvlab-tiny", "--kv-format", "int8", "--port", "70000"], "argument --port: must be <="),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--lengths", "64,,128"], "comma-separated integers"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--depths", "0,,1"], "comma-separated numbers"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--out", ""], "--out is empty"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--tokenizer", "x"], "--tokenizer is for a run against"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--max-tokens", "5"], "--max-tokens is for a run"),
    (["niah", "--endpoint", "", "--lengths", "64"], "endpoint URL must be a non-empty string, got ''"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--task", "chain", "--depths", "0"], "must be > 0"),
    (["niah", "--endpoint", "http://127.0.0.1:1", "--task", "chain", "--depths", "0,1"], "must be > 0"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--hops", "3"], "--hops is for --task chain"),
    (["niah", "--endpoint", "http://127.0.0.1:1", "--haystack-file", "EMPTY"], "the file is empty"),
    (["niah", "--endpoint", "http://127.0.0.1:1", "--chunk", "64"], "--chunk is for kvlab's own"),
    (["niah", "--endpoint", "http://127.0.0.1:1", "--tokenizer", " "], "--tokenizer is empty"),
    (["budget", "--model", "llama-3.1-8b", "--batch", "1", "--context", "8", "--memory-utilization", "0.5"],
     "--memory-utilization needs --gpu"),
    (["budget", "--model", "llama-3.1-8b", "--batch", "1", "--context", "8", "--weights-dtype", "int4"],
     "--weights-dtype needs --gpu"),
    (["budget", "--model", "llama-3.1-8b", "--batch", "1", "--context", "8", "--gpu", ""], "--gpu is empty"),
    (["serve", "--model", "kvlab-tiny", "--kv-format", "int8", "--host", "::1"], "IPv4 only"),
    (["serve-sim", "--workload", "chat", "--requests", "7"], "give a multiple of 5, got 7"),
    (["niah", "--endpoint", "http://exa mple.com", "--lengths", "64"], "has spaces or control characters"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--lengths", "64,64"], "lists a value twice"),
    (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--depths", "0.5,0.5"], "lists a value twice"),
    (["serve-sim", "--trace", "EMPTY", "--seed", "5"], "a --trace is replayed as recorded"),
    (["serve", "--model", "", "--kv-format", "int8"], "argument --model: is empty"),
    (["niah", "--model", " ", "--kv-format", "int8"], "argument --model: is empty"),
    (["niah", "--endpoint", "http://127.0.0.1:1", "--out", "/dev/stdout"], "a device or a process's stream"),
    (["niah", "--endpoint", "http://127.0.0.1:1", "--out", "r1.requests.jsonl"], "is a run's journal"),
    (["niah", "--kv-format", "int4", "--model", "/no/such/model"], "--model: could not load model '/no/such/model': no such folder"),
    (["serve", "--kv-format", "int4", "--model", "/no/such/model"], "--model: could not load model '/no/such/model': no such folder"),
    (["niah", "--kv-format", "int4", "--model", "m" * 5000], "characters)"),
    (["serve-sim", "--trace", "/no/such\n\x1b[31m"], "/no/such\\n\\x1b[31m"),
    (["niah", "--endpoint", "http://a\nb"], "has spaces or control characters"),
    (["budget", "--bogus"], "unrecognized arguments: --bogus"),
    (["budget", "--model", "llama-3.1-8b", "--bat", "1", "--context", "8"], "unrecognized arguments: --bat"),
    (["serve-sim", "--work", "rag"], "unrecognized arguments: --work"),
    (["budget", "-model", "x", "--batch", "1", "--context", "1"], "unrecognized arguments: -model"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_hostile_flags_get_one_line_fast(argv, needle, tmp_path, capsys):
    import time

    (tmp_path / "empty.txt").write_text("  \n")
    t = time.perf_counter()
    assert run([str(tmp_path / "empty.txt") if a == "EMPTY" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert time.perf_counter() - t < 5  # before any model loads


def test_serve_takes_vllms_max_model_len_up_to_the_models_positions(capsys, monkeypatch):
    from kvlab.server import CompletionServer

    assert run(["serve", "--model", "kvlab-tiny", "--kv-format", "int8", "--max-model-len", "40000"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len 40000 is longer than the model's 32,768 positions" in err and "Traceback" not in err
    seen = {}

    def serve_forever(self):
        seen["max_context"], seen["name"] = self.max_context, self.name
        raise KeyboardInterrupt

    monkeypatch.setattr(CompletionServer, "serve_forever", serve_forever)
    assert run(["serve", "--model", "kvlab-tiny", "--kv-format", "int8", "--port", "0", "--max-model-len", "64"]) == 0
    # a model kvlab names is served under that name (the id clients send), not its folder's
    assert seen == {"max_context": 64, "name": "kvlab-tiny"} and "up to 64 tokens" in capsys.readouterr().out
    assert run(["serve", "--model", "kvlab-tiny", "--kv-format", "int8", "--name", " "]) == 2
    assert "--name ' ' is empty or unprintable" in capsys.readouterr().err


def test_a_chain_takes_its_own_default_depths():
    from kvlab.cli import _task_problem, build_parser

    args = build_parser().parse_args(["niah", "--kv-format", "int8", "--task", "chain"])
    assert _task_problem(args) is None and args.depths == [1.0]
    args = build_parser().parse_args(["niah", "--kv-format", "int8"])
    assert _task_problem(args) is None and args.depths == [0.0, 0.5, 1.0]


def test_budget_survives_absurd_sizes_and_folder_names_that_are_not_utf8(tmp_path, capsys):
    import os

    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 10**400}
    folder = tmp_path / os.fsdecode(b"\xff\xfe")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    argv = ["budget", "--model", str(folder / "config.json"), "--batch", "2", "--context", "64", "--json"]
    assert run(argv + ["--gpu", "H200"]) == 2  # a vocabulary past any model's: its weights cannot be sized
    assert "has no parameter count" in capsys.readouterr().err
    assert run(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)  # strict JSON, encodable: no lone surrogates
    out.encode("utf-8")
    assert doc["cache_bytes"] > 0 and "\ufffd" in doc["model"]


def test_serve_keeps_waiting_for_a_step_that_outlasts_the_first_wait(capsys, monkeypatch):
    from kvlab.server import CompletionServer

    calls = []

    def serve_forever(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(CompletionServer, "serve_forever", serve_forever)
    monkeypatch.setattr(CompletionServer, "stop_generating", lambda self, timeout=60: calls.append(timeout) or len(calls) > 1)
    import signal

    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    assert run(["serve", "--model", "kvlab-tiny", "--kv-format", "int8", "--port", "0"]) == 0
    assert calls == [30, 30] and "still waiting for the model" in capsys.readouterr().err
    # called from Python (not the `kvlab` process), it leaves the caller's signal handlers as they were
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def test_out_paths_that_fail_inside_the_os_get_one_line(tmp_path, capsys):
    """A name too long, a path that ends like a folder, a journal linked to the result, a journal name too long:
    each refused before the run with the reason, never a traceback."""
    from kvlab.cli import main
    from kvlab.paths import WriteError, out_problem, write_json

    assert "file name too long" in out_problem(tmp_path / ("x" * 300 + ".json"))
    assert "names a folder" in out_problem(f"{tmp_path}/r.json/") and "names a folder" in out_problem("r.json/.")
    # the path lost its folder during a long run: WriteError (the commands print the result on stdout instead)
    with pytest.raises(WriteError, match="does not exist"):
        write_json(tmp_path / "gone" / "r.json", {"a": 1})
    (tmp_path / "r.json").write_text("{}\n")
    (tmp_path / "r.requests.jsonl").symlink_to(tmp_path / "r.json")  # the journal would overwrite the result
    assert main(["niah", "--endpoint", "http://127.0.0.1:1", "--out", str(tmp_path / "r.json")]) == 2
    assert "is a link to the result file itself" in capsys.readouterr().err
    long = tmp_path / ("y" * 250 + ".json")  # a legal name whose journal's name is not
    assert main(["niah", "--endpoint", "http://127.0.0.1:1", "--out", str(long)]) == 2
    err = capsys.readouterr().err
    assert "name too long" in err and "Traceback" not in err


def test_error_lines_cut_long_values_and_explain_negative_values(capsys):
    from kvlab.cli import main

    with pytest.raises(SystemExit):
        main(["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--trials", "9" * 5000])
    err = capsys.readouterr().err
    assert len(err) < 400 and "got 5,000, starting" in err  # the value is cut, not echoed whole
    with pytest.raises(SystemExit):
        main(["budget", "--batch", "-inf"])
    assert "goes as --flag=VALUE" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # nothing after the flag: no hint about values that start with '-'
        main(["budget", "--model", "llama-3.1-8b", "--batch"])
    err = capsys.readouterr().err
    assert "argument --batch: expected one argument" in err and "--flag=VALUE" not in err
    with pytest.raises(SystemExit):
        main(["niah", "--endpoint", "http://127.0.0.1:1", "--timeout", "1e308"])
    assert "argument --timeout: must be > 0 and at most 86400 seconds" in capsys.readouterr().err


def test_a_server_listing_thousands_of_models_is_named_briefly():
    from kvlab.endpoint import _ids

    text = _ids([f"m{i}" for i in range(100_000)])
    assert text.startswith("m0, m1") and text.endswith("(100,000 in all)") and len(text) < 120


# every number flag's parser, on any text: a value within its bounds, or one short line that names the problem
_NUMBER_PARSERS = {
    "--batch": lambda: cli.int_flag(1, 10**7), "--timeout": lambda: cli._seconds(False),
    "--backoff": lambda: cli._seconds(True), "--gpu-hour-usd": lambda: cli._positive_float,
    "--memory-utilization": lambda: cli._fraction, "--lengths": lambda: cli.length_list_flag,
    "--depths": lambda: cli._depth_list,
}


@settings(max_examples=300, deadline=None)
@given(flag=st.sampled_from(sorted(_NUMBER_PARSERS)),
       text=st.one_of(st.text(max_size=60), st.from_regex(r"-?[0-9０-９]{1,60}(\.[0-9]*)?(e-?[0-9]{1,4})?", fullmatch=True),
                      st.builds(lambda n: "9" * n, st.integers(1, 6000))))
def test_number_flags_take_a_value_in_bounds_or_refuse_in_one_short_line(flag, text):
    import argparse
    import math

    parse = _NUMBER_PARSERS[flag]()
    try:
        v = parse(text)
    except argparse.ArgumentTypeError as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) < 200, msg
        return
    assert text.strip().isascii()  # "４" (a full-width digit) is not taken for 4
    for x in (v if isinstance(v, list) else [v]):
        assert math.isfinite(x) and x >= 0
    if flag == "--timeout":
        assert cli.MIN_TIMEOUT_S <= v <= 86400
    if flag == "--batch":
        assert 1 <= v <= 10**7 and isinstance(v, int)


def test_number_flags_name_what_is_wrong(capsys):
    for argv, needle in ((["budget", "--batch", "４"], "ASCII digits"), (["budget", "--batch", "5\xa0"], "ASCII digits"),
                         (["budget", "--batch", "1_000"], "without '_' separators"),
                         (["budget", "--batch", "9" * 5000], "at most 40 characters, got 5,000, starting '99999"),
                         (["niah", "--endpoint", "http://127.0.0.1:1", "--timeout", "9" * 400], "at most 40 characters"),
                         (["niah", "--endpoint", "http://127.0.0.1:1", "--timeout", "1e999"], "got 1e999"),
                         (["niah", "--endpoint", "http://127.0.0.1:1", "--timeout", "5e-324"], "at least 0.001 seconds"),
                         (["niah", "--model", "kvlab-tiny", "--kv-format", "int8", "--seed", "-1"], "argument --seed: must be >= 0")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, (argv[:3], err)
        assert err.count(argv[-2]) == 1, ("the flag's name once (argparse gives it)", err)


def test_a_long_out_path_is_cut_in_the_error(tmp_path, capsys):
    long = str(tmp_path / "no-such-folder" / ("z" * 240)) + "/" + "y" * 3800 + ".json"
    assert cli.main(["niah", "--endpoint", "http://127.0.0.1:1", "--out", long]) == 2
    err = capsys.readouterr().err
    assert "characters)" in err and len(err) < 600 and err.count("\n") == 1


def test_odd_characters_in_values_and_paths_stay_on_one_escaped_line(tmp_path, capsys):
    for argv, needle in ((["budget", "--batch", "1\n" * 1500], "starting '1\\n1\\n"),
                         (["budget", "--batch", " " * 3000 + "x"], "characters)"),
                         (["niah", "--endpoint", "http://127.0.0.1:1", "--lengths", ", ".join(["1"] * 1500)], "characters)"),
                         (["serve-sim", "--gpu-hour-usd", "2e6"], "to 1,000,000 dollars per GPU-hour, got 2e6"),
                         (["serve-sim", "--gpu-hour-usd", "5e-324"], "from 0.001 to 1,000,000 dollars"),
                         (["serve-sim", "--gpu-hour-usd", "1e-400"], "> 0, got 1e-400 (it rounds to 0)"),
                         (["serve-sim", "--memory-utilization", "1e-400"], "(0, 1], got 1e-400 (it rounds to 0)"),
                         (["serve-sim", "--memory-utilization", "0.0"], "(0, 1], got 0.0\n"),
                         (["niah", "--endpoint", "http://127.0.0.1:1", "--timeout", "1e-400"], "rounds to 0"),
                         (["niah", "--endpoint", "http://127.0.0.1:1", "--out", str(tmp_path / "a\nb\x1b[2J" / "x.json")],
                          "a\\nb\\x1b[2J")):
        assert run(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1 and len(err) < 400 and "\x1b" not in err, (argv[:2], err)
    (tmp_path / "la").symlink_to(tmp_path / "lb")
    (tmp_path / "lb").symlink_to(tmp_path / "la")
    assert cli.main(["niah", "--endpoint", "http://127.0.0.1:1", "--out", str(tmp_path / "la" / "x.json")]) == 2
    assert "leads nowhere (or a loop)" in capsys.readouterr().err
    bad = tmp_path / "bad\udcff.json"  # a file name that is not UTF-8: its journal's length is measured in bytes
    assert cli.main(["niah", "--endpoint", "http://127.0.0.1:1", "--timeout", "0.5", "--retries", "0",
                     "--model", "kvlab-tiny", "--out", str(bad)]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert cli._depth_list("-0,1") == [0.0, 1.0] and str(cli._depth_list("-0")[0]) == "0.0"



@pytest.mark.parametrize("script", ["sweep_long.py", "gpu_check.py"])
def test_the_scripts_refuse_a_flag_in_one_line_named_by_the_script(script):
    """The data scripts share the CLI's parser: a bad flag is one line, no usage block in front of it, and what
    would act on a terminal is escaped."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / script), "--no-such-flag", "a\nb\x1b[2J"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr == f"{script}: error: unrecognized arguments: --no-such-flag a\\nb\\x1b[2J\n", r.stderr


def _run_script_in_a_fresh_python(script: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``scripts/<script> argv`` (or ``benchmarks/<name>.py`` argv) run as __main__ in a new interpreter; stdout is
    its exit code and whether torch was imported by then (``"2 False"``: refused before torch loaded)."""
    root = Path(__file__).resolve().parents[1]
    path = root / script if "/" in script else root / "scripts" / script
    code = ("import runpy, sys\n"
            f"sys.argv = [{str(path)!r}, *{argv!r}]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv", [["sweep_evals.py", "--resume", "--quick", "--out"],
                                  ["compare_engines.py", "--llama-cpp", "--lengths", "64", "--out"]])
@pytest.mark.parametrize("content", ["not json", "[1]"])
def test_a_script_refuses_an_out_file_it_did_not_write_before_torch_loads(argv, content, tmp_path):
    out = tmp_path / "old.json"
    out.write_text(content)
    r = _run_script_in_a_fresh_python(argv[0], argv[1:] + [str(out)])
    assert r.stdout == "2 False\n" and r.stderr.count("\n") == 1 and "move it away" in r.stderr, r
    assert out.read_text() == content


_LLAMA_DOC = {"model": "gemma3-270m", "lengths": [8192], "depths": [0.0, 0.25, 0.5, 0.75, 1.0], "trials": 5,
              "cache_types": {"f16": {"rows": [{"length": 8192, "depth": 0.0, "trials": 5, "correct": 4,
                                                "outcomes": [True, True, False, True, True]}], "seconds": 10.0,
                                      "partial": {"length": 8192, "depth": 0.25, "trials": 5, "outcomes": [True]}}},
              "runs": [{"machine": "x", "dates": ["2026-12-01", "2026-12-01"], "prompts": {"f16": 6}}]}


@pytest.mark.parametrize("change,argv,needle", [
    ({"runs": {"machine": "x"}}, [], "runs of the wrong type"),
    ({"runs": [{"machine": "x", "dates": ["d"], "prompts": {}}]}, [], "'runs' log is not one this script wrote"),
    ({"runs": [{"machine": "x", "dates": ["d", "e"], "prompts": {"f16": -3}}]}, [], "'runs' log is not one"),
    ({"cache_types": {"f16": {"rows": [{"length": 8192, "depth": 0.0, "trials": 5, "correct": 5,
                                        "outcomes": ["false", True, True, True, True]}], "seconds": 1}}}, [],
     "each row needs length"),
    ({"cache_types": {"f16": {"rows": [], "seconds": 1, "partial": {"length": 8192, "depth": "x", "trials": 5,
                                                                      "outcomes": []}}}}, [], "'partial' cell must hold"),
    ({"cache_types": {"q2_K": {"rows": [], "seconds": 1}}}, [], "cache type 'q2_K' is not one of"),
    ({"cache_types": {"f16": {"rows": [], "seconds": -1e6}}}, [], "seconds (a finite number >= 0)"),
    ({"depths": [1.0, 0.75, 0.5, 0.25, 0.1]}, [], "other settings (depths"),
    ({"trials": 3}, [], "a row ran another number of trials than the file's 3"),
    ({"trials": 3, "cache_types": {}}, [], "other settings (trials 3 there, 5 here)"),
    ({"model": "smollm2-135m"}, [], "other settings (model smollm2-135m there, gemma3-270m here)"),
    ({}, ["--lengths", "32768"], "holds a cut-off f16 cell (8192 tokens, depth 0.25, 5 trials, swa_full=None)"),
    ({}, ["--lengths", "8192", "--swa-cache", "window"], "holds a cut-off f16 cell (8192 tokens"),
    ({}, ["--quick"], "--quick would replace it"),
    ({}, ["--lengths", "65536"], "past gemma3-270m's 32,768-token window"),
    ({}, ["--quick", "--cache-types", "q4_0"], "drop --lengths, --depths, --trials and --cache-types"),
])
def test_compare_engines_refuses_a_resume_it_cannot_make_before_torch_loads(change, argv, needle, tmp_path):
    """A llama.cpp file is resumed only as the same experiment: a malformed or foreign file, other settings, a cut-off
    cell this run would drop, or a smoke test over it are refused in a line, and the file is left as it was."""
    out = tmp_path / "old.json"
    out.write_text(json.dumps({**_LLAMA_DOC, **change}))
    before = out.read_text()
    r = _run_script_in_a_fresh_python("compare_engines.py", ["--llama-cpp", "--model", "gemma3-270m", *argv,
                                                             "--out", str(out)])
    assert r.stdout == "2 False\n" and needle in r.stderr and "Traceback" not in r.stderr, r
    assert out.read_text() == before


@pytest.mark.parametrize("script", ["sweep_long.py", "compare_engines.py", "eval_model.py", "sweep_evals.py",
                                    *(pytest.param(b, marks=pytest.mark.slow)  # make quick keeps its minute
                                      for b in ("benchmarks/decode_cpu.py", "benchmarks/decode_attention.py",
                                                "benchmarks/shared_prefill.py"))])
def test_a_script_refuses_a_flag_before_torch_loads(script):
    """A mistyped flag costs well under a second: the scripts and benchmarks that run a model or a kernel import torch
    only after their flags are checked (train_model.py, whose helpers are torch functions, is the exception)."""
    r = _run_script_in_a_fresh_python(script, ["--no-such-flag"])
    assert r.stdout == "2 False\n" and r.stderr.count("\n") == 1, r
    # named even where a required choice is missing too (compare_engines.py needs a mode)
    assert r.stderr == f"{Path(script).name}: error: unrecognized arguments: --no-such-flag\n", r


@pytest.mark.slow  # subprocesses: make test, not make quick
@pytest.mark.parametrize("argv, why", [
    (["benchmarks/decode_attention.py", "--out", "{tmp}/no-such-folder"], "no-such-folder: no such folder"),
    (["benchmarks/decode_attention.py", "--out", "/dev"], "--out /dev: is a folder of devices"),
    (["benchmarks/decode_cpu.py", "--quick", "--formats", "int8"], "--quick sets --formats itself"),
    (["benchmarks/decode_cpu.py", "--formats", "int8", "INT8", "--out", "{tmp}/o.json"], "--formats lists int8 twice"),
    (["benchmarks/decode_cpu.py", "--contexts", "64", "64", "--out", "{tmp}/o.json"], "--contexts lists 64 twice"),
    (["benchmarks/decode_cpu.py", "--model", "", "--out", "{tmp}/o.json"], "argument --model: is empty"),
    (["benchmarks/decode_cpu.py", "--model", "{tmp}/no-model", "--out", "{tmp}/o.json"], "--model: could not load model"),
    (["benchmarks/shared_prefill.py", "--out", "{tmp}"], "--out"),
])
def test_a_benchmark_refuses_a_place_or_model_before_torch_loads(argv, why, tmp_path):
    """A result path or a model that cannot work is named before torch loads, not after the run."""
    r = _run_script_in_a_fresh_python(argv[0], [a.replace("{tmp}", str(tmp_path)) for a in argv[1:]])
    assert r.stdout == "2 False\n" and why in r.stderr and r.stderr.count("\n") == 1, r
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # subprocesses: make test, not make quick
@pytest.mark.parametrize("argv", [["sweep_long.py", "--lengths", "64", "--model"], ["sweep_evals.py", "--model"]])
def test_a_script_refuses_a_model_that_names_nothing_before_torch_loads(argv, tmp_path):
    r = _run_script_in_a_fresh_python(argv[0], argv[1:] + [str(tmp_path / "no-model"), "--out", str(tmp_path / "o")])
    assert r.stdout == "2 False\n" and "--model: could not load model" in r.stderr and r.stderr.count("\n") == 1, r
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # subprocesses: make test, not make quick
@pytest.mark.parametrize("argv", [["kvlab", "budget", "--model", "llama-3.1-8b", "--batch", "1", "--context", "8", "--gp"],
                                  ["sweep_long.py", "--length"], ["eval_model.py", "--long-trial"],
                                  ["kvlab.book", "--tim"]])
def test_a_flag_is_spelled_in_full(argv):
    """argparse accepts any unambiguous prefix of a flag by default; kvlab's parsers do not."""
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    cmd = {"kvlab": ["-m", "kvlab"], "kvlab.book": ["-m", "kvlab.book"]}.get(argv[0], [str(scripts / argv[0])])
    r = subprocess.run([sys.executable, *cmd, *argv[1:], "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"unrecognized arguments: {argv[-1]}" in r.stderr, r


@pytest.mark.parametrize("argv, why", [
    (["sweep_long.py", "--per-depth", "４"], "--per-depth: must be an integer written in ASCII digits"),
    (["sweep_long.py", "--lengths", "1_000"], "--lengths: must be an integer without '_'"),
    (["sweep_long.py", "--out", ""], "--out: is empty"),
    (["sweep_long.py", "--model", "/no/such/model", "--lengths", "64", "--out", "{tmp}/x.jsonl"], "--model: could not load"),
    (["sweep_evals.py", "--model", "", "--out", "{tmp}/e.json"], "--model: "),
    (["eval_model.py", "--lengths", "abc"], "--lengths: "),
    (["eval_model.py", "--lengths", "10"], "--lengths must be at least 64"),
    (["eval_model.py", "--long-trials", "-1"], "--long-trials: must be >= 0"),
    (["eval_model.py", "--card-only", "--prose-only"], "not allowed with argument --card-only"),
    (["train_model.py", "--threads", "-1"], "--threads: must be >= 0"),
    (["train_model.py", "--lr", "nan"], "--lr: must be from"),
    (["train_model.py", "--max-stages", "0"], "--max-stages: must be >= 1"),
    (["train_model.py", "--out", "/proc/x"], "--out /proc/x: "),
    (["compare_engines.py", "--llama-cpp", "--depths", "2"], "--depths: must be from 0 to 1"),
    (["compare_engines.py", "--quanto", "--lengths", "512", "512"], "--lengths lists 512 twice"),
    (["compare_engines.py", "--llama-cpp", "--quick", "--trials", "3"], "--quick runs one fixed case"),
    (["compare_engines.py", "--llama-cpp", "--new-tokens", "16"], "--new-tokens is not for --llama-cpp"),
    (["compare_engines.py", "--llama-cpp", "--cache-types", "q4_0", "q4_0"], "--cache-types lists q4_0 twice"),
    (["gpu_check.py", "--out", "/no/such/folder"], "--out /no/such/folder: no such folder"),
    (["gpu_check.py", "--out", "/proc"], "--out /proc: is a folder of devices or process streams"),
    (["gpu_check.py", "--out", "/etc/passwd"], "--out /etc/passwd: is not a folder"),
    (["train_model.py", "--out", "/etc/passwd"], "is a file: --out names the folder"),
])
def test_the_scripts_refuse_bad_values_before_any_work(argv, why, tmp_path, capsys, monkeypatch):
    """A bad value is refused in one line before a model loads or a file is written (the data scripts use the
    CLI's number and path types, so they refuse what it refuses). In-process: each script's main() with its
    program name as argparse would see it from the command line."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    spec = importlib.util.spec_from_file_location(argv[0].removesuffix(".py"), root / "scripts" / argv[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", [str(root / "scripts" / argv[0])])  # argparse names the program from it
    with pytest.raises(SystemExit) as e:
        mod.main(argv[1:])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.startswith(f"{argv[0]}: error: ") and why in err, err
    assert err.count("\n") == 1 and not out and not list(tmp_path.iterdir()), (out, err)


@pytest.mark.slow  # one Python start-up a script (torch imports): make test, not make quick
def test_every_script_and_benchmark_answers_help_and_refuses_an_unknown_flag_writing_nothing():
    """A script that ignored its arguments rewrote shipped files on `--help` or `--bogus` (issue 45)."""
    import subprocess
    import sys

    from kvlab.paths import ROOT

    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    for script in sorted([*(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        for flag, code in (("--help", 0), ("--bogus-flag", 2)):
            r = subprocess.run([sys.executable, str(script), flag], cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert r.returncode == code, (script.name, flag, r.stderr[-500:])
            assert "Traceback" not in r.stderr, (script.name, flag, r.stderr[-500:])
    after = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before, "a script wrote files when asked only for --help or given a bad flag"


def test_a_command_line_of_thousands_of_words_is_refused_before_argparse_reads_it(capsys):
    """argparse's time grows with the square of the words: 100,000 repeated flags took minutes."""
    from kvlab.cli import MAX_WORDS, main

    with pytest.raises(SystemExit) as e:
        main(["budget", "--model", "llama-3.1-8b", "--context", "4096"] + ["--batch", "1"] * MAX_WORDS)
    assert e.value.code == 2 and "words on the command line" in capsys.readouterr().err


def test_budget_errors_name_the_flag_and_gpu_only_flags_are_refused_even_at_their_default(capsys):
    from kvlab.cli import main

    for argv, first in ((["--kv-dtype", "int4@sliding"], "kvlab: error: --kv-dtype 'int4@sliding' quantizes sliding"),
                        (["--tp", "3"], "kvlab: error: --tp 3 must divide"),
                        (["--gpu", "xxx"], "kvlab: error: --gpu: unknown GPU 'xxx'"),
                        (["--memory-utilization", "0.9"], "kvlab: error: --memory-utilization needs --gpu"),
                        (["--weights-dtype", "bf16"], "kvlab: error: --weights-dtype needs --gpu")):
        assert main(["budget", "--model", "llama-3.1-8b", "--batch", "1", "--context", "16", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(first) and err.count("\n") == 1, err
