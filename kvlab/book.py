"""The chapters as a static HTML book: ``python -m kvlab.book OUT`` (``make book``).

Each notebook is executed (``nbclient``, as CI does) and exported with ``nbconvert`` to one page, with
a contents page beside them. The export is made to read without a kernel or a network:

* plotly figures are stored by the chapters as plotly JSON only; each becomes an interactive HTML
  figure drawn by one copy of ``plotly.min.js`` that ships with the ``plotly`` package and is copied
  next to the pages;
* widgets become the static snapshot that :mod:`kvlab.widgets` puts beside each one (its figures
  and tables as they were when the cell ran, and a note to open the notebook to move the controls);
* cells tagged ``hide-input`` (the chapters' prose-with-numbers and guard cells) show only their output;
* a Markdown heading collapsed in JupyterLab (cell metadata ``jp-MarkdownHeadingCollapsed``, which JupyterLab
  itself writes and honours) becomes a ``<details>`` block on the page, holding every cell up to the next
  heading of the same or a higher level: a chapter's evidence sits one click below its main path, in the
  notebook and in the book alike. :func:`main_path` measures what a reader sees without opening any.

A notebook that fails to execute fails the build with the cell and its traceback: the book build is
also how ``make test`` executes the chapters.
"""

from __future__ import annotations

import html
import re
import shutil
import sys
import time
from pathlib import Path

from .cli import Parser, int_flag, one_line, path_flag
from .paths import ROOT

NOTEBOOKS_DIR = ROOT / "notebooks"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
HIDE_INPUT = "hide-input"
REMOVE = "remove-cell"  # set by prepare() on hidden cells that show nothing (the chapters' silent checks)
COLLAPSED = "jp-MarkdownHeadingCollapsed"  # JupyterLab's own cell metadata for a folded heading
PAGES = ("glossary", "bibliography")
# chapters rewritten in layers (issue 41): their main path must meet these targets, checked on the built book
LAYERED = ("03_triton_attention", "04_where_int4_breaks", "05_prefix_cache", "06_choosing_a_format")
MAIN_PATH = {"words": 4000, "mean_sentence": 25, "before_figure": 800}  # notebooks/<name>.md, one page each, linked from the chapters


def chapters(folder: Path = NOTEBOOKS_DIR) -> list[Path]:
    """The chapter notebooks in reading order (their file names start with the chapter number)."""
    found = sorted(Path(folder).glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise FileNotFoundError(f"no chapter notebooks (NN_name.ipynb) in {folder}")
    return found


def title(nb) -> str:
    """The first Markdown heading of a notebook, without its '#'s."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return "Untitled"


def execute(path: Path, timeout: int = 900):
    """Run every cell of one notebook in a fresh kernel, in the notebook's folder; return the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                   store_widget_state=False).execute()
    return nb


def prepare(nb) -> dict:
    """Make an executed notebook read without a kernel: plotly JSON -> HTML, widgets -> their snapshots.

    Returns counts: ``figures`` (plotly figures now drawn by the page, widget snapshots included)
    and ``widgets`` (widgets replaced by a snapshot).
    """
    import plotly.io as pio

    counts = {"figures": 0, "widgets": 0}
    nb.metadata.pop("widgets", None)  # no widget state: the page must not try to load a widget manager
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if HIDE_INPUT in cell.metadata.get("tags", []):
            cell.metadata.setdefault("jupyter", {})["source_hidden"] = True
            if not cell.get("outputs"):  # a check that held: nothing for the reader to see
                cell.metadata["tags"] = [*cell.metadata.get("tags", []), REMOVE]
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                fig = pio.from_json(_json(data.pop(PLOTLY_MIME)))
                data["text/html"] = pio.to_html(fig, include_plotlyjs=False, full_html=False,
                                                config={"responsive": True})
                counts["figures"] += 1
            elif WIDGET_MIME in data:
                data.pop(WIDGET_MIME)
                if "text/html" in data:
                    counts["widgets"] += 1
                    counts["figures"] += data["text/html"].count("Plotly.newPlot")
                else:  # a widget kvlab did not make: say so instead of printing its repr
                    data.pop("text/plain", None)
                    data["text/html"] = ("<p class='kvlab-snapshot-note'>An interactive widget is here: open the "
                                         "notebook in JupyterLab (<code>make lab</code>) to use it.</p>")
    return counts


def _md_nb(path: Path):
    import nbformat

    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(Path(path).read_text(encoding="utf-8"))])


def _json(value) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)


PAGE_CSS = """
body { max-width: 72rem; margin: 0 auto; padding: 0 1rem; }
nav.kvlab-book { display: flex; justify-content: space-between; padding: 0.75rem 0; border-bottom: 1px solid #ddd;
                 font-family: system-ui, sans-serif; }
nav.kvlab-book.bottom { border-top: 1px solid #ddd; border-bottom: none; }
.kvlab-snapshot-note { color: #555; font-style: italic; }
details.kvlab-fold { border-left: 3px solid #ccd; margin: 0.75rem 0; padding-left: 0.5rem; }
details.kvlab-fold > summary { cursor: pointer; font-family: system-ui, sans-serif; font-weight: 600; padding: 0.4rem 0; }
details.kvlab-fold > div.jp-Cell:first-of-type .jp-RenderedMarkdown > :is(h1, h2, h3, h4, h5):first-child { display: none; }
.jp-RenderedMarkdown pre { background: #f6f6f8; border: 1px solid #e2e2e8; padding: 0.5rem 0.75rem; overflow-x: auto; }
"""


def _nav(prev: tuple[str, str] | None, nxt: tuple[str, str] | None, cls: str = "") -> str:
    left = f"<a href='{prev[0]}'>&larr; {html.escape(prev[1])}</a>" if prev else "<span></span>"
    right = f"<a href='{nxt[0]}'>{html.escape(nxt[1])} &rarr;</a>" if nxt else "<span></span>"
    return f"<nav class='kvlab-book {cls}'>{left}<a href='index.html'>Contents</a>{right}</nav>"


def export(nb, page_title: str, prev=None, nxt=None) -> str:
    """One chapter page: nbconvert's lab template, hidden inputs removed, plotly.js from the page's folder."""
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    c = Config()
    c.TagRemovePreprocessor.enabled = True
    c.TagRemovePreprocessor.remove_input_tags = {HIDE_INPUT}
    c.TagRemovePreprocessor.remove_cell_tags = {REMOVE}
    exporter = HTMLExporter(config=c, template_name="lab")
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": page_title}})
    # no chapter writes math, and prices do have dollar signs: MathJax (from a CDN, so absent offline anyway)
    # would typeset "$2.20 ... $1.15" as a formula
    body = _MATHJAX.sub("", body)
    body = fold(body, nb)
    head = f"<script src='plotly.min.js'></script><style>{PAGE_CSS}</style>"
    body = body.replace("</head>", head + "</head>", 1)
    top, bottom = _nav(prev, nxt), _nav(prev, nxt, "bottom")
    i = body.index(">", body.index("<body")) + 1
    body = body[:i] + top + body[i:]
    return relink(body.replace("</body>", bottom + "</body>", 1))


def heading_level(cell) -> int | None:
    """The level of a Markdown cell's first heading (1 for ``#``), or ``None`` when it has none."""
    if cell.get("cell_type") != "markdown":
        return None
    for line in cell.get("source", "").splitlines():
        m = re.match(r"(#{1,6})\s", line)
        if m:
            return len(m[1])
    return None


def folds(cells) -> list[tuple[int, int]]:
    """``(start, end)`` cell ranges that JupyterLab hides under each collapsed heading: from the heading's cell
    up to (not including) the next heading of the same or a higher level, as JupyterLab folds them."""
    out = []
    for i, cell in enumerate(cells):
        level = heading_level(cell)
        if level is None or not cell.get("metadata", {}).get(COLLAPSED):
            continue
        end = next((j for j in range(i + 1, len(cells)) if (heading_level(cells[j]) or 99) <= level), len(cells))
        out.append((i, end))
    return out


def _summary(cell) -> str:
    line = next(x for x in cell.source.splitlines() if re.match(r"#{1,6}\s", x))
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())  # a link's text, not its target
    return html.escape(re.sub(r"[*_`]", "", text))


_CELL_DIV = re.compile(r'<div class="jp-Cell [^"]*" id="cell-id=([^"]+)">')


def fold(page: str, nb) -> str:
    """Each collapsed heading's cells wrapped in a closed ``<details>`` (its summary the heading's text)."""
    spans = folds(nb.cells)
    if not spans:
        return page
    starts = {m[1]: m.start() for m in _CELL_DIV.finditer(page)}
    end_of_cells = page.rindex("</main>") if "</main>" in page else len(page)

    def offset(index: int) -> int:  # where cell `index` starts on the page, or the next one shown after it
        for cell in nb.cells[index:]:
            if cell.get("id") in starts:
                return starts[cell["id"]]
        return end_of_cells

    inserts = []  # (offset, order, text): at one offset, closing tags before opening ones
    for a, b in spans:
        inserts.append((offset(a), 1, f"<details class='kvlab-fold'><summary>{_summary(nb.cells[a])}</summary>"))
        inserts.append((offset(b), 0, "</details>"))
    for at, _, text in sorted(inserts, key=lambda x: (x[0], x[1]), reverse=True):
        page = page[:at] + text + page[at:]
    return page


_WORD = re.compile(r"[A-Za-z0-9][\w'’.,%+−-]*")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]*_]*\s+(?=[\"'(\[*_`]*[A-Z0-9])")


def _plain(markdown: str) -> list[str]:
    """Markdown as plain text lines: no code blocks, no HTML, no ``<details>`` blocks, link targets dropped."""
    text = re.sub(r"<details.*?</details>", " ", markdown, flags=re.S)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return [re.sub(r"[*_`>]", "", line).strip() for line in text.splitlines()]


def main_path(nb) -> dict:
    """What a reader sees of an executed chapter without opening a fold: ``words`` (prose and tables),
    ``mean_sentence`` (words a sentence, tables and bullets' lead-ins counted as prose lines), ``before_figure``
    (words before the first figure; all of them when there is none) and ``figures`` (figures on the main path)."""
    spans = folds(nb.cells)
    hidden, summaries = {i for a, b in spans for i in range(a + 1, b)}, {a for a, _ in spans}
    words, sentences, before, figures = 0, [], None, 0
    for i, cell in enumerate(nb.cells):
        if i in hidden:
            continue
        if i in summaries:  # a fold shows its heading only
            texts = [next(x for x in cell.source.splitlines() if re.match(r"#{1,6}\s", x))]
        else:
            texts = [cell.source] if cell.cell_type == "markdown" else []
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            data = out.get("data", {})
            if PLOTLY_MIME in data or "image/png" in data or "image/svg+xml" in data or \
                    "Plotly.newPlot" in data.get("text/html", ""):
                figures += 1
                before = words if before is None else before
            elif "text/markdown" in data:
                texts.append(_as_text(data["text/markdown"]))
        for text in texts:
            prose = []
            for line in _plain(text):
                n = len(_WORD.findall(line))
                words += n
                if n and not line.startswith(("|", "#")):  # tables and headings are not sentences
                    prose.append(line)
            paragraph = " ".join(prose)
            sentences += [len(_WORD.findall(s)) for s in _SENTENCE_END.split(paragraph) if _WORD.search(s)]
    return {"words": words, "mean_sentence": sum(sentences) / max(1, len(sentences)), "sentences": len(sentences),
            "before_figure": words if before is None else before, "figures": figures}


def _as_text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


_MATHJAX = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.S)
_PAGES_RE = "|".join(PAGES)
_LINK = re.compile(r"""href=(["'])(?:\./)?((?:\d\d_\w+\.ipynb)|(?:""" + _PAGES_RE + r""")\.md)(#[^"']*)?\1""")


def relink(page: str) -> str:
    """Links between chapters (``02_x.ipynb``) and to the glossary and bibliography (``glossary.md``), as
    written for JupyterLab, pointed at the book's own pages (``02_x.html``, ``glossary.html``)."""
    return _LINK.sub(lambda m: f"href={m[1]}{Path(m[2]).stem}.html{m[3] or ''}{m[1]}", page)


def markdown_page(path: Path, prev=None, nxt=None) -> str:
    """A Markdown file of the notebooks folder (the glossary, the bibliography) as a book page."""
    nb = _md_nb(path)
    return export(nb, title(nb), prev, nxt)


def build(out: str | Path, notebooks: list[Path] | None = None, *, timeout: int = 900, progress: bool = True) -> dict:
    """Execute and export every chapter into ``out`` (created); returns ``{page: counts}``.

    Writes ``index.html``, one page a chapter, ``plotly.min.js``, and ``executed/`` with each notebook
    as it ran (outputs included).
    """
    import nbformat
    import plotly

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out {str(out)!r} exists and is not a folder")
    notebooks = [Path(p) for p in (notebooks or chapters())]
    for p in notebooks:  # every notebook read before anything is written
        if not p.is_file():
            raise FileNotFoundError(f"no notebook at {p}")
        try:
            nbformat.validate(nbformat.read(p, as_version=4))
        except Exception as e:  # not JSON, not UTF-8, not a notebook's shape: nbformat raises each its own way
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"{p} is not a Jupyter notebook ({why})") from None
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", out / "plotly.min.js")
    executed, report = [], {}
    for p in notebooks:
        t0 = time.perf_counter()
        nb = execute(p, timeout=timeout)
        (out / "executed").mkdir(exist_ok=True)
        nbformat.write(nb, out / "executed" / p.name)  # as the chapter ran, outputs included (for reading and debugging)
        counts = prepare(nb)
        counts["seconds"] = round(time.perf_counter() - t0, 1)
        executed.append((p, nb, title(nb)))
        report[p.with_suffix(".html").name] = counts | {"title": title(nb), "notebook": p.name}
        if progress:
            print(f"  {p.name}: {counts['figures']} figures, {counts['widgets']} widget snapshots, "
                  f"{counts['seconds']:.0f} s", file=sys.stderr, flush=True)
    # then the Markdown pages (glossary, bibliography), in the same chain of pages
    docs = [(p.with_suffix(".html").name, t, nb) for p, nb, t in executed]
    for name in PAGES:
        if (NOTEBOOKS_DIR / f"{name}.md").is_file():
            nb = _md_nb(NOTEBOOKS_DIR / f"{name}.md")
            docs.append((f"{name}.html", title(nb), nb))
            report[f"{name}.html"] = {"title": title(nb), "figures": 0, "widgets": 0}
    pages = [(name, t) for name, t, _ in docs]
    for i, (name, t, nb) in enumerate(docs):
        prev, nxt = pages[i - 1] if i else None, pages[i + 1] if i + 1 < len(pages) else None
        (out / name).write_text(export(nb, t, prev, nxt))
    items = "\n".join(f"<li><a href='{name}'>{html.escape(t)}</a></li>" for name, t in pages)
    (out / "index.html").write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvlab: KV-cache quantization, measured</title>"
        f"<style>{PAGE_CSS} body {{ font-family: system-ui, sans-serif; }}</style></head><body>"
        "<h1>kvlab: KV-cache quantization, measured</h1><p>The workbook's chapters, executed. Figures are "
        "interactive; widgets are static snapshots (open the notebooks in JupyterLab, <code>make lab</code>, to "
        f"move their controls).</p><ol>{items}</ol></body></html>")
    return report


def out_folder_problem(out: Path) -> str | None:
    """Why the book cannot be written into ``out`` (a folder, made if missing), or None: checked before a chapter runs."""
    from .paths import folder_problem

    if out.exists() or out.is_symlink():
        return folder_problem(out, "out")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:  # mkdir(parents=True) makes the missing folders
        parent = parent.parent
    why = folder_problem(parent, "out")
    return None if why is None else f"{why} (the folder that would hold {out})"


def main(argv=None) -> int:
    p = Parser(prog="python -m kvlab.book", description="Execute the chapters into a static HTML book.")
    p.add_argument("out", nargs="?", type=path_flag, default=ROOT / "build" / "book", help="folder to write (default build/book)")
    p.add_argument("--timeout", type=int_flag(1, 86_400), default=900, help="seconds per cell")
    p.add_argument("--only", nargs="+", type=path_flag, help="these notebooks instead of every chapter")
    args = p.parse_args(argv)
    if why := out_folder_problem(Path(args.out)):  # the out folder is checked first, and blamed as itself
        p.error(why)
    try:
        report = build(args.out, args.only, timeout=args.timeout)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvlab.book: error: {'--only: ' if args.only else ''}{one_line(e)}", file=sys.stderr)
        return 2
    print(f"wrote {len(report)} chapters to {args.out}/index.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
