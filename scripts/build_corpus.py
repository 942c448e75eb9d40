"""Build the shipped English text corpus from CPython's standard-library docstrings.

Why this text: the project must work offline, and the Python interpreter already
carries a few megabytes of English prose under a known licence (the Python
Software Foundation License) in its modules' docstrings. We collect them
deterministically (sorted module and member names), split by module into a
training set and a held-out set (every 10th module is held out), and write both
gzipped under ``data/corpus/``.

Run:  python scripts/build_corpus.py
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import pkgutil
import re
import sys
import warnings
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "corpus"
SKIP = ("test", "idlelib", "tkinter", "turtledemo", "lib2to3", "antigravity", "this", "__")


def module_names() -> list[str]:
    names = set(sys.stdlib_module_names)
    return sorted(n for n in names if not n.startswith(SKIP))


def docstrings(modname: str) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mod = importlib.import_module(modname)
        except Exception:
            return []
    docs = []
    seen = set()

    def add(obj):
        d = inspect.getdoc(obj)
        if d and len(d) > 80 and d not in seen:
            seen.add(d)
            docs.append(d)

    add(mod)
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != modname:
            continue
        add(obj)
        if inspect.isclass(obj):
            for _, meth in sorted(vars(obj).items()):
                if callable(meth):
                    add(meth)
    if hasattr(mod, "__path__"):  # packages: walk their submodules too
        for info in sorted(pkgutil.iter_modules(mod.__path__), key=lambda i: i.name):
            if not info.name.startswith(("_", "test")):
                docs += docstrings(f"{modname}.{info.name}")
    return docs


def clean(text: str) -> str:
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return "".join(ch for ch in text if ch.isascii())


def main(argv=None) -> None:
    from kvlab.cli import Parser

    Parser(description=__doc__.splitlines()[0]).parse_args(argv)  # no flags: --help answers, anything else is refused
    OUT.mkdir(parents=True, exist_ok=True)
    train, held = [], []
    for i, name in enumerate(module_names()):
        docs = [clean(d) for d in docstrings(name)]
        (held if i % 10 == 0 else train).extend(docs)
    for split, docs in (("train", train), ("heldout", held)):
        text = "\n\n".join(docs) + "\n"
        with gzip.open(OUT / f"{split}.txt.gz", "wt", encoding="utf-8", compresslevel=9) as f:
            f.write(text)
        print(f"{split}: {len(docs)} docstrings, {len(text) / 1e6:.2f} MB of text")


if __name__ == "__main__":
    main()
