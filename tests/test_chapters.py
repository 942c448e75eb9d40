"""Chapter 4's main-path values on small synthetic model facts (oracle values written out), and on the shipped data."""

import pytest

from kvlab import facts, prose
from kvlab.chapters import where_int4_breaks as ch4
from kvlab.results import Paired


def _model(held, worse_at, prose_at, pooled_lost):
    lengths = [1024, 4096, 8192]
    return {"held": held, "lengths": lengths, "by": {f: {"worse_at": w} for f, w in worse_at.items()},
            "prose": {"by": {f: {"worse_at": w} for f, w in prose_at.items()}},
            "pooled": {f: Paired(f, "fp32", 75, 70 - n, 70, n, 0) for f, n in pooled_lost.items()}}


def test_needle_cell_says_where_a_format_was_worse():
    m = _model(["a"], {"a": [], "b": [4096], "c": [], "d": [1024, 4096, 8192]},
               {"b": [4096, 8192], "d": [1024, 4096, 8192]}, {"a": 0, "b": 3, "c": 7, "d": 40})
    assert ch4.needle_cell(m, "a") == "✓"
    assert ch4.needle_cell(m, "b") == "✗ 4k; prose 4k, 8k"
    assert ch4.needle_cell(m, "c") == "✗ pooled"  # 7 lost, none gained: p = 0.016
    assert ch4.needle_cell(m, "d") == "✗ every length"


def test_flip_rate_is_the_largest_chance_gain_of_an_8bit_format():
    def model(gains):
        return {"pooled": {f: Paired(f, "fp32", 200, 150, 150 - g + 1, 1, g) for f, g in zip(ch4.EIGHT_BIT, gains)}}
    assert ch4.flip_rate({"S": model([0, 1, 2]), "G": model([3, 0, 0])}) == 3 / 200


def test_the_main_path_sections_hold_and_render_on_the_shipped_data():
    F = facts.where_int4_breaks()
    for section, fn in ch4.SECTIONS.items():
        values = fn(F)
        assert values.failed() == {}, section
        assert prose.render("04_where_int4_breaks", section, values).strip()
    card = ch4.card(F).splitlines()
    assert len(card) == 2 + len(ch4.CARD) and all(f"`{f}`" in "\n".join(card) for f in ch4.CARD)


@pytest.mark.slow  # computes four chapters' facts (chapter 5's replays): the book build shows the page too
def test_the_start_page_states_what_the_chapters_found():
    from kvlab.chapters import start_here

    X = start_here.found()
    assert X.failed() == {}
    text = prose.render("00_start_here", "found", X)
    assert len(text.split()) <= 300 and "What we found" in text
    assert ("decode speed on a GPU" in text) == (not start_here.gpu_runs()), "the unmeasured list follows the data"


def test_gpu_runs_are_the_gpu_check_files(tmp_path):
    from kvlab.chapters import start_here

    (tmp_path / "gpu_H100_2026-12-01.json").write_text("{}")
    (tmp_path / "decode_cpu.json").write_text("{}")
    assert [p.name for p in start_here.gpu_runs(tmp_path)] == ["gpu_H100_2026-12-01.json"]


def test_values_a_scale_reads_the_key_layout():
    # per token: a head's whole key; groups: their size; KIVI-4: 32 tokens of one channel; per tensor: everything
    assert [ch4.values_a_scale(f, 256) for f in ("int4_token", "int4", "q4_0", "int4_g16", "kivi-4")] == [256, 64, 32, 16, 32]
    assert ch4.values_a_scale("int4_tensor", 256) == float("inf")
