"""Every chapter's facts hold on the shipped data, and every sentence of its prose renders (make quick)."""

import pytest

from kvlab import facts, prose
from kvlab.chapters import choosing_a_format, prefix_cache, triton_attention, where_int4_breaks

SECTIONS = {"04_where_int4_breaks": where_int4_breaks.SECTIONS, "06_choosing_a_format": choosing_a_format.SECTIONS,
            "05_prefix_cache": prefix_cache.SECTIONS, "03_triton_attention": triton_attention.SECTIONS}  # chapters whose sections have their own function


@pytest.fixture(scope="module", params=sorted(facts.CHAPTERS))
def chapter(request):
    return request.param, facts.CHAPTERS[request.param]()


def test_every_claim_a_chapter_makes_holds_on_the_shipped_data(chapter):
    name, F = chapter
    assert F.claims, f"{name} states no claims"
    assert F.failed() == {}


def test_every_section_of_the_chapter_renders(chapter):
    """Sections named live-... are filled from what the chapter measures when it runs (the book build renders them).
    A section backed by its own function in kvlab.chapters renders from that function's facts, whose claims hold."""
    name, F = chapter
    backed = SECTIONS.get(name, {})
    for section in [s for s in prose.sections(name) if not s.startswith("live-")]:
        values = backed[section](F) if section in backed else F
        assert getattr(values, "failed", dict)() == {}, section
        text = prose.render(name, section, values)
        assert "{" not in text.replace("{{", "") and text.strip(), section


@pytest.mark.parametrize("name", sorted(p.stem for p in prose.PROSE_DIR.glob("*.md")))
def test_every_section_is_shown_by_its_chapter_and_every_shown_section_exists(name):
    """A section no cell shows would be prose nobody reads (and a claim nobody sees); a cell showing a section
    the file lacks would fail only when the book is built."""
    import json
    import re

    nb = json.loads((prose.PROSE_DIR.parent / f"{name}.ipynb").read_text())
    src = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    sections = prose.sections(name)
    assert f'prose.show("{name}",' in src  # (sections named live-... are filled from values measured as the chapter runs)
    for section in sections:
        shown = f'"{section}"' in src or any(f'"{section.rsplit("-", k)[0]}"' in src for k in (1, 2))
        assert shown, section
    assert set(re.findall(rf'prose\.show\("{name}", "([\w.-]+)"', src)) <= set(sections)
    for q in re.findall(rf'prose\.question\("{name}", "([\w.-]+)"', src):  # a question's options are its sections
        assert q in sections


def test_a_failing_claim_stops_the_page_and_names_the_sentence():
    F = facts.Facts({"x": 1}, {"x is two": (False, 1), "x is one": (True, 1)})
    assert F.failed() == {"x is two": 1}
    with pytest.raises(AssertionError, match="x is two"):
        F.check()


def test_render_names_a_missing_fact_and_an_unknown_section(tmp_path):
    (tmp_path / "c.md").write_text("<!-- section: a -->\nx = {x:.1f}, y = {y[0]}\n<!-- section: b -->\nplain\n")
    assert prose.render("c", "b", {}, tmp_path) == "plain"
    assert prose.render("c", "a", {"x": 2, "y": [3]}, tmp_path) == "x = 2.0, y = 3"
    with pytest.raises(KeyError, match="no fact named y"):
        prose.render("c", "a", {"x": 2}, tmp_path)
    with pytest.raises(KeyError, match="no section 'z'"):
        prose.render("c", "z", {}, tmp_path)
    (tmp_path / "d.md").write_text("<!-- section: a -->\n1\n<!-- section: a -->\n2\n")
    with pytest.raises(ValueError, match="twice"):
        prose.sections("d", tmp_path)


def test_a_mitigation_is_tested_against_its_base_on_the_same_prompts(tmp_path):
    """Pooled over lengths: 'fixed' = base wrong and mitigation right on one prompt; 'broke' the reverse."""
    import json

    from kvlab.results import LongSweep, mcnemar

    fmts = {f: {} for f in ("fp32", "int4_token", "int4_token+rotate", "kivi-2", "kivi-2+rotate")}
    recs = []
    for n in (1024, 4096):
        for i in range(10):  # rotation fixes 4 prompts a length and breaks none; on KIVI-2 it fixes 1 and breaks 1
            recs.append({"stage": "filler", "length": n, "depth": 0.0, "index": i, "correct": {
                "fp32": True, "int4_token": i >= 4, "int4_token+rotate": True,
                "kivi-2": i != 0, "kivi-2+rotate": i != 1}})
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [{"kind": "header", "model": "m", "formats": fmts}, *recs]) + "\n")
    vs = facts.against_base(LongSweep.load(p))
    assert set(vs) == {"int4_token+rotate", "kivi-2+rotate"}  # the others were not run
    assert vs["int4_token+rotate"] | {"p": None} == {"base": "int4_token", "fixed": 8, "broke": 0, "prompts": 20,
                                                    "p": None, "verdict": "better"}
    assert vs["int4_token+rotate"]["p"] == mcnemar(0, 8) < 0.01
    assert (vs["kivi-2+rotate"]["fixed"], vs["kivi-2+rotate"]["broke"]) == (2, 2)
    assert vs["kivi-2+rotate"]["verdict"] == "not distinguishable"


def test_chapter_2s_shipped_costs_hold():
    """Chapter 2 measures its errors live; what E5M2 and NVFP4 cost on held-out text it reads from chapter 4's sweeps."""
    C = facts.format_costs()
    assert len(C.claims) == 3 and C.failed() == {}
    assert set(C["ppl"]["nvfp4"]) == {"SmolLM2", "Gemma"}


def test_a_format_added_later_counts_in_the_risk_only_once_both_haystacks_are_whole(tmp_path):
    """Chapter 6's risk reads formats added to a sweep later (--add-formats): their perplexity as soon as every
    held-out window is in, their needle verdict only once every length of both haystacks is; chapter 4's lists
    keep the sweep's own formats."""
    import json
    import math

    from kvlab.results import LongSweep

    head = {"kind": "header", "model": "m", "formats": {"fp32": {}, "int8": {}}, "depths": [0.0], "per_depth": 6}
    recs = [{"stage": st, "length": n, "depth": 0.0, "index": i, "key": str(i), "correct": {"fp32": True, "int8": True}}
            for st in ("filler", "prose") for n in (1024, 4096) for i in range(6)]
    recs += [{"stage": "perplexity", "length": 513, "depth": 0.0, "index": i, "tokens": 512,
              "nll": {"fp32": 100.0, "int8": 100.5}} for i in range(4)]
    added = [{"kind": "formats", "formats": {"fp8_e5m2": {"bits_per_element": 8.0}}}]
    added += [{"stage": "perplexity", "length": 513, "depth": 0.0, "index": i, "tokens": 512,
               "nll": {"fp8_e5m2": 102.0}, "added": True} for i in range(4)]
    added += [{"stage": "filler", "length": n, "depth": 0.0, "index": i, "key": str(i), "correct": {"fp8_e5m2": True},
               "added": True} for n in (1024, 4096) for i in range(6)]
    prose = [{"stage": "prose", "length": n, "depth": 0.0, "index": i, "key": str(i), "correct": {"fp8_e5m2": i > 0},
              "added": True} for n in (1024, 4096) for i in range(6)]
    p = tmp_path / "s.jsonl"
    for extra, needle in ((added, None), (added + prose[:3], None), (added + prose[:6], None), (added + prose, "held")):
        p.write_text("\n".join(json.dumps(x) for x in [head, *recs, *extra]) + "\n")
        sw = LongSweep.load(p)
        own, every = facts._model_facts(sw), facts._model_facts(sw, sw.all_formats)
        assert "fp8_e5m2" not in own["by"] and "fp8_e5m2" not in own["ppl"]
        assert every["ppl"]["fp8_e5m2"] == pytest.approx(math.exp(4 * 2.0 / (4 * 512)) - 1)
        risk = facts.paired_risk(model_facts=[every])["m"]
        assert risk["needle"].get("fp8_e5m2") == needle and ("fp8_e5m2" in risk["held"]) == (needle == "held")


def test_a_format_added_later_is_ruled_out_by_a_loss_at_a_finished_length(tmp_path):
    """Worse at a length already whole is a verdict before the other lengths are in (chapter 6 reads it as
    "worse ... so far"); a format without such a loss still waits for every length."""
    import json

    from kvlab.results import LongSweep

    head = {"kind": "header", "model": "m", "formats": {"fp32": {}}, "depths": [0.0], "per_depth": 6}
    recs = [{"stage": st, "length": n, "depth": 0.0, "index": i, "key": str(i), "correct": {"fp32": True}}
            for st in ("filler", "prose") for n in (1024, 4096) for i in range(6)]
    added = [{"kind": "formats", "formats": {"int4_tensor": {"bits_per_element": 4.0}, "int8": {"bits_per_element": 8.0}}}]
    added += [{"stage": "filler", "length": 1024, "depth": 0.0, "index": i, "key": str(i),  # 4096: not run yet
               "correct": {"int4_tensor": False, "int8": True}, "added": True} for i in range(6)]
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [head, *recs, *added]) + "\n")
    sw = LongSweep.load(p)
    mf = facts._model_facts(sw, sw.all_formats)
    assert mf["partial"] == {"int4_tensor": ("filler", [1024])} and "int4_tensor" not in mf["by"]
    risk = facts.paired_risk(model_facts=[mf])["m"]
    assert risk["needle"]["int4_tensor"] == "worse in filler at 1k so far" and "int4_tensor" not in risk["held"]
    assert "int8" not in risk["needle"]  # never worse where it ran: no verdict until every length is in
    assert facts._model_facts(sw)["partial"] == {}  # chapter 4 reads the sweep's own formats only


def test_chapter_6_says_where_the_added_formats_needles_stand_while_they_run_and_once_they_are_in():
    smol = {"name": "SmolLM2-135M-Instruct", "by": {"a": {}, "b": {}}, "partial": {}}
    running = {"name": "Gemma 3 270M", "by": {}, "partial": {"b": ("filler", [8192])}}
    text = facts._added_status_md(["a", "b"], [smol, running], ["a"])
    assert "needles on SmolLM2 so far, so none of them can pass yet (`a` in 6.2's table wait on Gemma's needles" in text
    assert "on Gemma `b` (filler, at 8k) was already found worse" in text
    done = dict(running, by={"a": {}, "b": {}}, partial={})
    assert facts._added_status_md(["a", "b"], [smol, done], []).startswith("their perplexity and their needles are in on both")


def test_llamacpp_on_gemma_is_tabled_beside_kvlab_with_each_sides_verdict(tmp_path):
    import json

    from kvlab.results import LongSweep

    fmts = {f: {} for f in ("fp32", "q4_0", "q8_0")}
    recs = [{"stage": "filler", "length": 64, "depth": 0.0, "index": i,
             "correct": {"fp32": True, "q4_0": True, "q8_0": True}} for i in range(8)]
    recs += [{"stage": "cached", "length": 64, "depth": 0.0, "index": i, "correct": {"q4_0": i >= 6}} for i in range(8)]
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [{"kind": "header", "model": "m", "formats": fmts}, *recs]) + "\n")
    sweep = LongSweep.load(p)
    assert facts.llamacpp_gemma(sweep, tmp_path / "absent.json")["llama_gemma_ran"] is False

    def row(outcomes):
        return {"length": 64, "depth": 0.0, "trials": 8, "correct": sum(outcomes), "outcomes": outcomes}

    doc = {"machine": "cpu", "date": "2026-12-02", "seconds": 120, "cache_types": {
        "f16": {"rows": [row([True] * 8)]}, "q8_0": {"rows": [row([True] * 8)]},
        "q4_0": {"rows": [row([i >= 7 for i in range(8)])]}}}
    (tmp_path / "l.json").write_text(json.dumps(doc))
    v = facts.llamacpp_gemma(sweep, tmp_path / "l.json")
    assert v["llama_gemma_ran"] and v["llama_gemma_agree"]  # both call q4_0 worse (−7 and −6), q8_0 not
    assert "| q4_0 | 64 | 1/8 | −7 +0 ✗ | `q4_0` (prompt reads the cache) | 2/8 | −6 +0 ✗ | 7/8 |" in v["llama_gemma_md"]
    assert "q4_0 at 64: llama.cpp worse (−7 +0), kvlab worse (−6 +0)" in v["llama_gemma_summary_md"]
    # set directly against each other: only prompt 6 differs (kvlab right, llama.cpp wrong)
    assert ("differed in correctness on at most 1 of 8 (q4_0 at 64: kvlab alone right on 1, llama.cpp alone on 0); "
            "the exact test found no difference in any row (smallest p 1.00)") in v["llama_gemma_summary_md"]
    assert "*Not finished" not in v["llama_gemma_md"]
    doc["cache_types"]["q4_0"]["rows"] = [row([True] * 8)]
    (tmp_path / "l.json").write_text(json.dumps(doc))
    v = facts.llamacpp_gemma(sweep, tmp_path / "l.json")
    assert not v["llama_gemma_agree"]
    assert ("at most 6 of 8 (q4_0 at 64: kvlab alone right on 0, llama.cpp alone on 6); the exact test found a "
            "difference in q4_0 at 64 (smallest p 0.03)") in v["llama_gemma_summary_md"]
    doc["cache_types"]["q4_0"]["rows"] = []
    doc["cache_types"]["q4_0"]["partial"] = {"length": 64, "depth": 0.0, "trials": 8, "outcomes": [True, False]}
    doc |= {"lengths": [64], "depths": [0.0], "trials": 8}
    (tmp_path / "l.json").write_text(json.dumps(doc))
    v = facts.llamacpp_gemma(sweep, tmp_path / "l.json")
    assert "*Not finished, so not in the table:* q4_0 at 64: 2 of 8 prompts run so far" in v["llama_gemma_md"]
    assert "| q4_0 |" not in v["llama_gemma_md"]


def test_a_needle_verdict_says_whether_holms_correction_keeps_it():
    from kvlab.results import LONG_SWEEPS, LongSweep

    mfs = [facts._model_facts(sw, sw.all_formats) for sw in (LongSweep.load(p) for p in LONG_SWEEPS.values())]
    for fmt in ("nvfp4", "lmdeploy-int4", "fp8_e4m3"):
        text = facts._needle_with_holm_md(fmt, mfs)
        for mf in mfs:
            name = facts.short_model_name(mf["name"])
            if fmt in mf["held"]:
                assert "held on" in text and name in text.split(";")[0]
            else:
                kept = "withdraws" if fmt in mf["holm_rescued"] else "keeps"
                assert f"on {name} {facts.needle_label(mf, fmt)}, which Holm's correction {kept}" in text
    assert facts._needle_with_holm_md("no-such-format", mfs) == "not measured"


def test_the_two_prefill_modes_sentence_keeps_what_holm_keeps_and_brackets_the_rest():
    from kvlab.results import Paired

    same, better = Paired("a", "a", 25, 20, 20, 0, 0), Paired("b", "b", 25, 22, 16, 0, 6)
    assert facts._modes_holm_md({"a 8192": same}, {"a 8192": False}, "F") == "the two modes are not distinguishable"
    kept = facts._modes_holm_md({"a 8192": same, "b 32768": better}, {"a 8192": False, "b 32768": True}, "F")
    assert kept == "Holm's correction over F keeps `b` at 32k better with the prompt reading the cache (−0 +6, p = 0.03)"
    dropped = facts._modes_holm_md({"b 32768": better}, {"b 32768": False}, "F")
    assert dropped.startswith("no difference survives Holm's correction over F; uncorrected, `b` at 32k was better")


def test_the_eval_to_keep_is_the_rung_that_let_through_fewest_needle_losses():
    """Chapter 4's check-yourself answer is graded by the sweeps: a loss at a middle length passes the short and the
    longest needle (both rungs count it), perplexity over its bar catches it, and an 8-bit format never counts."""
    def row(ppl_ok, short="not worse", worse_at=()):
        return {"ppl_increase": 0.01 if ppl_ok else 0.5, "ppl_ok": ppl_ok, "short_verdict": short,
                "worse_at": list(worse_at)}

    model = {"name": "M", "lengths": [1024, 4096, 32768], "longest": 32768, "prose": {"by": {}},
             "held": ["fp32", "int8", "int4_fine"],
             "by": {"int8": row(True, worse_at=[4096]),            # 8-bit: not an INT4 case, whatever it did
                    "int4_fine": row(False),                        # a false alarm of perplexity
                    "int4_mid": row(False, worse_at=[4096]),        # lost at 4k only: both needle rungs miss it
                    "int4_short": row(True, "worse", [1024])}}     # the short needle and... not perplexity
    q = facts._refuse_to_skip([model])
    assert q["n_failed"] == 2 and q["n_false"] == {"ppl": 1, "short": 1, "long": 2} and q["n_needles_only"] == 1
    assert q["answer"] in ("ppl", "short") and q["false_md"]["long"] == "`int4_mid` on M; `int4_short` on M"
    model["by"]["int4_short"]["ppl_ok"] = False
    assert facts._refuse_to_skip([model])["answer"] == "ppl"
