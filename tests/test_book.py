"""The static HTML book (make book): every chapter executes, and every figure survives the export."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from kvlab import book

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_prepare_turns_plotly_and_widgets_into_static_html():
    import plotly.graph_objects as go

    nb = nbformat.v4.new_notebook()
    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))
    cell = nbformat.v4.new_code_cell("fig", metadata={"tags": ["hide-input"]})
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={book.PLOTLY_MIME: fig.to_plotly_json()}),
        nbformat.v4.new_output("display_data", data={book.WIDGET_MIME: {"model_id": "x"}, "text/plain": "VBox()",
                                                     "text/html": "<div>snapshot <script>Plotly.newPlot(1)</script></div>"}),
        nbformat.v4.new_output("display_data", data={book.WIDGET_MIME: {"model_id": "y"}, "text/plain": "Button()"}),
    ]
    nb.cells = [nbformat.v4.new_markdown_cell("# Chapter 9 · Test"), cell]
    nb.metadata["widgets"] = {"state": {}}
    counts = book.prepare(nb)
    assert counts == {"figures": 2, "widgets": 1}
    a, b, c = (o["data"] for o in cell.outputs)
    assert "Plotly.newPlot" in a["text/html"] and book.PLOTLY_MIME not in a
    assert book.WIDGET_MIME not in b and "snapshot" in b["text/html"]
    assert "open the notebook" in c["text/html"] and "text/plain" not in c
    assert "widgets" not in nb.metadata and book.title(nb) == "Chapter 9 · Test"
    page = book.export(nb, "Test")
    assert "plotly.min.js" in page and "Contents" in page
    assert 'hl-ipython3' not in page, "the hide-input cell's code should be gone from the page"


def test_silent_checks_vanish_and_links_point_at_pages():
    nb = nbformat.v4.new_notebook()
    check = nbformat.v4.new_code_cell("claims({'x': True})  # CHECK-CELL", metadata={"tags": ["hide-input"]})
    nb.cells = [nbformat.v4.new_markdown_cell("# T\n\nSee [chapter 2](02_quantize_real_kv.ipynb#2.1) and the "
                                              "[glossary](glossary.md#kl); [elsewhere](https://example.org/x.ipynb)."),
                check]
    book.prepare(nb)
    page = book.export(nb, "T")
    assert "CHECK-CELL" not in page, "a check with no output leaves no cell"
    assert 'href="02_quantize_real_kv.html#2.1"' in page and 'href="glossary.html#kl"' in page
    assert 'href="https://example.org/x.ipynb"' in page


def test_a_price_stays_a_price_on_the_page():
    """Two dollar signs in one paragraph are not a formula: the pages load no MathJax, and the chapters' prose
    escapes "$" for JupyterLab's Markdown (kvlab.prose.dollars)."""
    from kvlab.prose import dollars

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [nbformat.v4.new_output("display_data", {"text/markdown": dollars("BF16 $2.20, FP8 **$1.15**")})]
    nb.cells = [nbformat.v4.new_markdown_cell("# T"), cell]
    page = book.export(nb, "T")
    assert "mathjax" not in page.lower() and "$2.20" in page and "$1.15</strong>" in page
    assert dollars("$2 and $3") == r"\$2 and \$3" and dollars(r"\$2") == r"\$2"  # once, not twice


def test_glossary_and_bibliography_are_pages_with_the_anchors_chapters_link():
    import re

    anchors = set(re.findall(r'<a id="([\w-]+)">', (book.NOTEBOOKS_DIR / "glossary.md").read_text()))
    used = set()
    for p in [*book.chapters(), *sorted((book.NOTEBOOKS_DIR / "prose").glob("*.md"))]:
        used |= set(re.findall(r"glossary\.md#([\w-]+)", p.read_text()))
    assert used and used <= anchors, f"links to missing glossary entries: {used - anchors}"
    page = book.markdown_page(book.NOTEBOOKS_DIR / "bibliography.md")
    assert "<h1" in page and "KIVI" in page and "Contents" in page


def test_the_glossary_states_the_workbooks_constants():
    """The glossary is static Markdown: its numbers must be the ones the library uses."""
    from kvlab.budget import GIB
    from kvlab.results import PPL_TOLERANCE
    from kvlab.roofline import MBU, MFU

    text = (book.NOTEBOOKS_DIR / "glossary.md").read_text()
    assert f"assumes {MBU:.0%}" in text and f"one bar for it: {PPL_TOLERANCE:.0%}" in text
    assert f"and {MFU:.0%} of peak FLOPs" in text
    assert f"is {1 - 1e9 / GIB:.0%} smaller" in text
    from kvlab.formats import get_format
    from kvlab.results import exact_upper

    assert f"0 losses in 250 prompts it is about {exact_upper(0, 250):.1%}" in text
    assert f"{get_format('nvfp4').bits_per_element(128):.1f} bits an element; Blackwell" in text
    from kvlab.formats import engines_offering

    assert set(engines_offering(["nvfp4"])["nvfp4"]) == {"TensorRT-LLM", "vLLM", "SGLang"}  # the NVFP4 entry names them
    assert "and TensorRT-LLM, vLLM\nand SGLang offer it as a KV cache" in text


def test_build_refuses_bad_paths(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        book.build(tmp_path / "file", [])
    with pytest.raises(FileNotFoundError, match="no notebook"):
        book.build(tmp_path / "out", [tmp_path / "missing.ipynb"])
    with pytest.raises(FileNotFoundError, match="no chapter notebooks"):
        book.chapters(tmp_path)


@pytest.mark.parametrize("content", [b"#!/bin/sh\n", b"{}", b"[1, 2]", b"\xff\xfe", b'{"cells": 3}'])
def test_the_book_refuses_a_file_that_is_not_a_notebook_before_writing(tmp_path, content, capsys):
    bad = tmp_path / "bad.ipynb"
    bad.write_bytes(content)
    assert book.main([str(tmp_path / "out"), "--only", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlab.book: error: --only: {bad} is not a Jupyter notebook") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_an_out_folder_that_cannot_be_written_is_blamed_as_itself_before_anything_runs(tmp_path, capsys):
    f = tmp_path / "a_file"
    f.write_text("x")
    for out, why in ((f, "is not a folder"), (f / "sub", "is not a folder (the folder that would hold"),
                     (Path("/proc/kvlab-book"), "devices or process streams")):
        with pytest.raises(SystemExit) as e:
            book.main([str(out), "--only", str(tmp_path / "missing.ipynb")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and "--only" not in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_every_chapter_executes_into_the_book(built_book):
    out, report = built_book
    chapters = book.chapters()
    assert sorted(report) == sorted([p.with_suffix(".html").name for p in chapters] + [f"{n}.html" for n in book.PAGES])
    index = (out / "index.html").read_text()
    for page, r in report.items():
        text = (out / page).read_text()
        assert f"href='{page}'" in index, f"the contents page should link {page}"
        assert "Traceback (most recent call last)" not in text, f"{page} shows a traceback"
        assert text.count("Plotly.newPlot") >= r["figures"], page
        assert not re.search(r"""href=["'](?!https?:)[^"']*\.(?:ipynb|md)\b""", text), \
            f"{page} links a notebook or Markdown file the book does not have"
        assert "claims checked against the data" not in text, f"{page} still prints a line per checked paragraph"
        if "notebook" not in r:  # the glossary and the bibliography
            continue
        assert text.count("kvlab-ledger") == 1, f"{page}: one collapsed line of checked claims"
        nb = nbformat.read(book.NOTEBOOKS_DIR / r["notebook"], 4)
        for cell in nb.cells:
            if cell.cell_type == "code" and book.HIDE_INPUT in cell.metadata.get("tags", []):
                first = cell.source.strip().splitlines()[0]
                assert html.escape(first) not in text, f"{page}: a hide-input cell's code is visible: {first!r}"
    assert (out / "plotly.min.js").stat().st_size > 1_000_000
    for name in book.LAYERED:  # the answer in one screen, a figure early, short sentences; the evidence folded
        m = book.main_path(nbformat.read(out / "executed" / f"{name}.ipynb", 4))
        assert m["figures"] >= 1 and m["words"] <= book.MAIN_PATH["words"], (name, m)
        assert m["mean_sentence"] <= book.MAIN_PATH["mean_sentence"], (name, m)
        assert m["before_figure"] <= book.MAIN_PATH["before_figure"], (name, m)
        assert book.folds(nbformat.read(book.NOTEBOOKS_DIR / f"{name}.ipynb", 4).cells), f"{name} folds no evidence"
    figures = {p: r["figures"] for p, r in report.items() if "notebook" in r}
    assert all(n > 0 for p, n in figures.items() if not p.startswith("00_")), f"a chapter without figures: {figures}"


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make browser-deps)")
def test_the_book_shows_every_figure_in_a_browser(built_book):
    """Each page, opened from disk with no kernel and no network, draws every figure it promises."""
    from playwright.sync_api import sync_playwright

    out, report = built_book
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            for page_name, r in report.items():
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors = []
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                page.goto((out / page_name).as_uri())
                if r["figures"]:
                    page.wait_for_function(f"document.querySelectorAll('.plotly-graph-div .main-svg').length >= "
                                           f"{r['figures']}", timeout=60_000)
                drawn = page.evaluate("document.querySelectorAll('.plotly-graph-div .main-svg').length")
                divs = page.evaluate("document.querySelectorAll('.plotly-graph-div').length")
                assert divs == r["figures"], f"{page_name}: {divs} figure divs, expected {r['figures']}"
                assert drawn >= r["figures"], f"{page_name}: only {drawn} drawn of {r['figures']}"
                assert not [e for e in errors if "Plotly" in e or "plotly" in e], f"{page_name}: {errors}"
                # at 1280 px nothing is cut off: no output scrolls sideways, no axis title leaves its figure
                cut = page.evaluate("""[...document.querySelectorAll('.jp-OutputArea-output, .jp-RenderedHTMLCommon')]
                    .filter(e => e.scrollWidth > e.clientWidth + 2).map(e => e.innerText.slice(0, 80))""")
                assert not cut, f"{page_name}: cut off at 1280 px: {cut}"
                clipped = page.evaluate("""[...document.querySelectorAll('.plotly-graph-div')].flatMap(div => {
                    const box = div.getBoundingClientRect();
                    return [...div.querySelectorAll('.g-xtitle, .g-ytitle, .gtitle')].filter(t => {
                        const r = t.getBoundingClientRect();
                        return r.width && (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1
                                           || r.bottom > box.bottom + 1);
                    }).map(t => t.textContent.slice(0, 60)); })""")
                assert not clipped, f"{page_name}: axis or figure titles clipped: {clipped}"
                shots = out / "screenshots"
                shots.mkdir(exist_ok=True)
                page.screenshot(path=str(shots / page_name.replace(".html", ".png")), full_page=True)
                page.close()
        finally:
            browser.close()


def _folding_notebook():
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    fold = {book.COLLAPSED: True}
    nb = nbformat.v4.new_notebook()
    figure = code("fig")
    figure.outputs = [nbformat.v4.new_output("display_data", data={book.PLOTLY_MIME: {"data": [], "layout": {}}})]
    prose = code("show()")
    prose.outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": "Two words. <details>hidden "
                                                                                   "answer words</details>"})]
    nb.cells = [md("# Chapter 9 · T\n\nThe answer is short. It has three sentences. See [this](02_x.ipynb)."),
                figure, prose,
                md("## Evidence: every [verdict](glossary.md#x)\n\nMany more words here.", metadata=fold),
                code("evidence_figure"),
                md("### Deeper\n\nStill hidden.", metadata=fold),
                md("## Exercises\n\n| a | b |\n|---|---|\n| one | two |")]
    nb.cells[4].outputs = [nbformat.v4.new_output("display_data", data={book.PLOTLY_MIME: {"data": [], "layout": {}}})]
    return nb


def test_a_collapsed_heading_folds_its_cells_into_details_on_the_page():
    nb = _folding_notebook()
    assert book.folds(nb.cells) == [(3, 6), (5, 6)]  # to the next heading of the same or a higher level
    book.prepare(nb)
    page = book.export(nb, "T")
    opened, closed = page.index("<details class='kvlab-fold'><summary>Evidence: every verdict</summary>"), \
        page.index("</details></details>")
    assert opened < page.index("Many more words") < page.index("Still hidden") < closed < page.index("Exercises")
    assert page.index("The answer is short") < opened and page.count("<details class='kvlab-fold'>") == 2


def test_main_path_counts_only_what_is_not_folded():
    m = book.main_path(_folding_notebook())
    assert m["figures"] == 1, "the figure inside the fold is not on the main path"
    assert m["before_figure"] == len("Chapter 9 · T The answer is short. It has three sentences. See this.".split()) - 1
    assert m["words"] == m["before_figure"] + 2 + 3 + 1 + 4, "a fold shows its heading; <details> answers are left out"
    assert m["sentences"] == 4 and m["mean_sentence"] == pytest.approx((4 + 4 + 2 + 2) / 4)
