"""Chapter prose as Markdown templates, filled from the facts the library computes.

A chapter's sentences live in ``notebooks/prose/<chapter>.md``, where they can be edited as prose.
Each section starts with a line ``<!-- section: NAME -->`` and runs to the next one; numbers are
``{field:format}`` placeholders (Python's format syntax) filled from a :class:`kvlab.facts.Facts`. A file whose
first line is ``<!-- template: jinja2 -->`` is a Jinja2 template instead: ``{{ x | fmt(".0%") }}`` for a
number, and ``{% if ... %}`` for a sentence whose wording the data choose, so that no English is built in Python.
The facts module checks every claim a sentence makes against the data, with named thresholds, and
``tests/test_facts.py`` renders every section in ``make quick``: a change to shipped data or to the
library that breaks a sentence fails there, not at the end of the book build. A section named
``live-...`` states what the chapter measures as it runs; the chapter fills it from a ``Facts`` of those
measurements (with their claims), so only the book build renders it.

    >>> from kvlab import facts, prose
    >>> prose.show("05_prefix_cache", "costs", facts.prefix_cache())    # in a chapter: one line
"""

from __future__ import annotations

import re
import string
from pathlib import Path

from .paths import ROOT

PROSE_DIR = ROOT / "notebooks" / "prose"
_HEAD = re.compile(r"^<!-- section: ([\w.-]+) -->\s*$", re.M)
JINJA = "<!-- template: jinja2 -->"


def is_jinja(chapter: str, folder: Path | None = None) -> bool:
    """Whether a chapter's prose file is written in Jinja2 (its first line says so)."""
    path = (folder or PROSE_DIR) / f"{chapter}.md"
    return path.is_file() and path.read_text(encoding="utf-8").lstrip().startswith(JINJA)


def _env():
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=False)
    env.filters["fmt"] = lambda value, spec="": format(value, spec)  # Python's format spec: ".0%", ",", "+.1%"
    env.filters["names"] = lambda xs, empty="none": ", ".join(f"`{x}`" for x in xs) or empty
    return env


def sections(chapter: str, folder: Path | None = None) -> dict[str, str]:
    """``{name: template}`` of one chapter's prose file."""
    path = (folder or PROSE_DIR) / f"{chapter}.md"
    if not path.is_file():
        raise FileNotFoundError(f"no prose file {path}")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith(JINJA):
        text = text.lstrip()[len(JINJA):]
    heads = list(_HEAD.finditer(text))
    if not heads:
        raise ValueError(f"{path} has no '<!-- section: NAME -->' lines")
    out = {}
    for h, nxt in zip(heads, heads[1:] + [None]):
        name = h[1]
        if name in out:
            raise ValueError(f"{path}: section {name!r} appears twice")
        out[name] = text[h.end():nxt.start() if nxt else len(text)].strip()
    return out


def fields(template: str, jinja: bool = False) -> set[str]:
    """The top-level names a template's placeholders read."""
    if jinja:
        from jinja2 import meta

        return set(meta.find_undeclared_variables(_env().parse(template)))
    return {re.split(r"[.\[]", f)[0] for _, f, _, _ in string.Formatter().parse(template) if f}


def render(chapter: str, section: str, facts, folder: Path | None = None) -> str:
    """One section filled from ``facts`` (a mapping); names a missing fact and the section it is in."""
    temps = sections(chapter, folder)
    if section not in temps:
        raise KeyError(f"{chapter}.md has no section {section!r} (it has {', '.join(temps)})")
    jinja = is_jinja(chapter, folder)
    missing = sorted(fields(temps[section], jinja) - set(facts.keys()))
    if missing:
        raise KeyError(f"{chapter}.md, section {section!r}: no fact named {', '.join(missing)}")
    if not jinja:
        return temps[section].format_map(facts)
    import jinja2

    try:
        return _env().from_string(temps[section]).render(dict(facts)).strip()
    except jinja2.UndefinedError as e:  # a key or attribute inside a fact
        raise KeyError(f"{chapter}.md, section {section!r}: {e.message}") from None


def show(chapter: str, section: str, facts) -> None:
    """Display a rendered section as Markdown (in a notebook), after checking the facts' claims."""
    from IPython.display import Markdown, display

    check = getattr(facts, "check", None)
    if check is not None:
        check()
        from .check import record

        record(getattr(facts, "claims", {}))
    display(Markdown(dollars(render(chapter, section, facts))))


def dollars(markdown: str) -> str:
    """``$`` escaped for Jupyter's Markdown, which reads the text between two dollar signs as LaTeX: "$2.20 per
    million ... $1.15" would otherwise be typeset as one formula (the workbook's prose has prices, no math)."""
    return re.sub(r"(?<!\\)\$", r"\\$", markdown)


def question(chapter: str, name: str, facts, answer: str, folder: Path | None = None) -> dict:
    """A multiple-choice question written in a chapter's prose file, for :class:`kvlab.check.MultipleChoice`.

    Section ``name`` is the question; each section ``name-KEY`` is one option: its first line (after
    ``OPTION:``) is the option's text, the rest the feedback shown when it is picked. ``answer`` is the
    KEY of the right option (computed from the data by the chapter's facts).
    """
    temps = sections(chapter, folder)
    opts = {k[len(name) + 1:]: render(chapter, k, facts, folder) for k in temps if k.startswith(name + "-")}
    if answer not in opts:
        raise KeyError(f"{chapter}.md has no option {name}-{answer} (it has {', '.join(opts) or 'none'})")
    choices, right = {}, None
    for key, text in opts.items():
        first, _, rest = text.partition("\n")
        if not first.startswith("OPTION:"):
            raise ValueError(f"{chapter}.md, section {name}-{key}: the first line must start with 'OPTION:'")
        option = first[len("OPTION:"):].strip()
        choices[option] = rest.strip()
        if key == answer:
            right = option
    return {"question": render(chapter, name, facts, folder), "choices": choices, "answer": right}
