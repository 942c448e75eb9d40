"""Check-yourself cells (multiple choice, numeric answers, coding exercises) and the chapters' guards.

:func:`claims` is how a chapter keeps its prose honest: the sentences a cell prints are
listed, in words, with the comparison on the data that supports each; if the data stops
supporting one, the cell fails and names it. Otherwise it prints one line.

Each question works two ways: call ``.check(answer)`` to get a :class:`Feedback`
(what the tests and the executed notebooks use), or display the object in
Jupyter to get a small widget that answers on click.

Exercises diagnose mistakes by *running* them: each known mistake is given as a
small buggy implementation, and when the reader's function agrees with one of
those instead of the reference, the feedback names that mistake.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .claim import holds


@dataclass
class Feedback:
    correct: bool
    message: str

    def __bool__(self):
        return self.correct

    def _repr_markdown_(self):
        return ("✅ **Correct.** " if self.correct else "❌ **Not yet.** ") + self.message

    def _repr_html_(self):
        import html

        head = "✅ <b>Correct.</b> " if self.correct else "❌ <b>Not yet.</b> "
        return head + html.escape(self.message)

    def __str__(self):
        return ("Correct. " if self.correct else "Not yet. ") + self.message


def _feedback_widget(make_input, on_check, reveal: str):
    """An input, a Check button, an HTML line for the feedback, and a button that reveals the answer."""
    import ipywidgets as w

    inp = make_input()
    out = w.HTML()
    btn = w.Button(description="Check", button_style="primary")
    show = w.Button(description="Show the answer")

    def clicked(_):
        out.value = on_check(inp.value)._repr_html_()

    def revealed(_):
        out.value = reveal

    btn.on_click(clicked)
    show.on_click(revealed)
    return w.VBox([inp, w.HBox([btn, show]), out])


def _show(widget, snapshot: str) -> None:
    """Display ``widget`` live, with a static HTML ``snapshot`` beside it for exports (the HTML book)."""
    from IPython.display import display

    bundle = widget._repr_mimebundle_()
    bundle = bundle[0] if isinstance(bundle, tuple) else bundle
    display({**bundle, "text/html": snapshot}, raw=True)


def _reveal_html(question_html: str, body_html: str, answer_html: str) -> str:
    return (f"<div class='kvlab-quiz'><p>{question_html}</p>{body_html}<details><summary>Show the answer</summary>"
            f"{answer_html}</details></div>")


def _shuffled(question: str, options: list[str]) -> list[str]:
    """A fixed order that does not depend on the order the author wrote the options in."""
    import hashlib

    return sorted(options, key=lambda o: hashlib.sha1((question + "\0" + o).encode()).hexdigest())


class MultipleChoice:
    """``choices`` maps each option's text to the explanation shown when it is picked.

    Options are shown in a fixed order derived from their text (not the order written), and an
    answer much longer than every other option is refused: length must not give it away.
    """

    def __init__(self, question: str, choices: dict[str, str], answer: str):
        if answer not in choices:
            raise ValueError(f"answer {answer!r} is not one of the choices")
        if len(choices) < 2:
            raise ValueError("a multiple-choice question needs at least two choices")
        longest_other = max(len(c) for c in choices if c != answer)
        if len(answer) > 1.3 * longest_other:
            raise ValueError(f"the answer ({len(answer)} characters) is much longer than every other option "
                             f"(at most {longest_other}): its length gives it away; balance the options")
        self.question, self.choices, self.answer = question, dict(choices), answer
        self.options = _shuffled(question, list(choices))

    def check(self, choice) -> Feedback:
        if isinstance(choice, int) and not isinstance(choice, bool):
            if not 0 <= choice < len(self.options):
                raise ValueError(f"choice index must be in [0, {len(self.options)}), got {choice}")
            choice = self.options[choice]
        if choice not in self.choices:
            raise ValueError(f"{choice!r} is not one of the choices: {self.options}")
        return Feedback(choice == self.answer, self.choices[choice])

    def _answer_html(self) -> str:
        import html

        return f"<p><b>{html.escape(self.answer)}</b> {html.escape(self.choices[self.answer])}</p>"

    def widget(self):
        import ipywidgets as w

        return w.VBox([
            w.HTML(f"<b>{self.question}</b>"),
            _feedback_widget(
                lambda: w.RadioButtons(options=self.options, value=None, layout={"width": "max-content"}),
                lambda v: Feedback(False, "Pick an answer first.") if v is None else self.check(v),
                self._answer_html(),
            ),
        ])

    def snapshot_html(self) -> str:
        """The question as static HTML (the book): each option opens onto the feedback for picking it."""
        import html

        items = "".join(f"<li><details><summary>{html.escape(o)}</summary><p>{html.escape(self.choices[o])}</p>"
                        f"</details></li>" for o in self.options)
        return _reveal_html(f"<b>{html.escape(self.question)}</b>", f"<ol type='a'>{items}</ol>", self._answer_html())

    def _ipython_display_(self):
        _show(self.widget(), self.snapshot_html())


def _finite(name: str, value) -> float:
    """``value`` as a finite float, or ``ValueError`` naming ``name``."""
    try:
        x = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        x = math.nan
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return x


class Numeric:
    """A numeric answer within a relative tolerance; ``mistakes`` maps wrong values to explanations."""

    def __init__(self, question: str, answer: float, rel_tol: float = 0.02, unit: str = "",
                 mistakes: dict[str, float] | None = None, explanation: str = ""):
        if isinstance(rel_tol, bool) or not isinstance(rel_tol, int | float) or not 0 < rel_tol < 1:
            raise ValueError(f"rel_tol must be a fraction in (0, 1), got {rel_tol!r}")
        for arg, v in (("question", question), ("unit", unit), ("explanation", explanation)):
            if not isinstance(v, str):
                raise TypeError(f"{arg} must be text, got {type(v).__name__}")
        if mistakes is not None and not isinstance(mistakes, dict):
            raise TypeError(f"mistakes must be a dict {{explanation: wrong value}}, got {type(mistakes).__name__}")
        self.question, self.answer, self.rel_tol, self.unit = question, _finite("answer", answer), rel_tol, unit
        self.mistakes = {str(msg): _finite(f"the mistake {msg!r}", v) for msg, v in (mistakes or {}).items()}
        self.explanation = explanation

    def _close(self, a, b):
        return math.isclose(a, b, rel_tol=self.rel_tol, abs_tol=1e-12)

    def check(self, value) -> Feedback:
        try:
            value = float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
            return Feedback(False, f"Enter a number, got {str(value)[:40]!r}.")
        if not math.isfinite(value):
            return Feedback(False, f"Enter a finite number, got {value}.")
        if self._close(value, self.answer):
            return Feedback(True, self.explanation or f"{self.answer:,.6g} {self.unit}".strip())
        for msg, v in self.mistakes.items():
            if self._close(value, v):
                return Feedback(False, msg)
        if value and self.answer:
            ratio = value / self.answer
            return Feedback(False, f"Your answer is {ratio:.3g}x the expected value. Recheck each factor.")
        return Feedback(False, "Recheck each factor.")

    def _answer_html(self) -> str:
        import html

        hints = "".join(f"<li><b>{v:,.6g}</b>: {html.escape(msg)}</li>" for msg, v in self.mistakes.items())
        hints = f"<details><summary>Got another number?</summary><ul>{hints}</ul></details>" if hints else ""
        return f"<p><b>{self.answer:,.6g} {html.escape(self.unit)}</b> {html.escape(self.explanation)}</p>{hints}"

    def widget(self):
        import ipywidgets as w

        return w.VBox([
            w.HTML(f"<b>{self.question}</b>" + (f" ({self.unit})" if self.unit else "")),
            _feedback_widget(lambda: w.FloatText(value=0.0), self.check, self._answer_html()),
        ])

    def _ipython_display_(self):
        import html

        unit = f" ({html.escape(self.unit)})" if self.unit else ""
        _show(self.widget(), _reveal_html(f"<b>{html.escape(self.question)}</b>{unit}", "", self._answer_html()))


def _same(a, b, atol) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], atol) for k in a)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y, atol) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.is_floating_point() != b.is_floating_point():
            return False
        if a.device != b.device:  # a tensor on another device (or "meta", which holds no values) is not the answer
            return False
        if not a.is_floating_point():  # integer codes: the exact dtype matters (int8 is not int16)
            return a.dtype == b.dtype and torch.equal(a.to(torch.int64), b.to(torch.int64))
        return torch.allclose(a.double(), b.double(), atol=atol, rtol=0, equal_nan=True)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


def _difference(got, want, atol, where: str = "the result") -> str:
    """What differs between the reader's output and the reference, in words: type, length, shape, dtype, range, values."""
    if isinstance(want, tuple | list):
        if not isinstance(got, tuple | list):
            return f"{where} should be a tuple of {len(want)}, got a {type(got).__name__}."
        if len(got) != len(want):
            return f"{where} should have {len(want)} parts, got {len(got)}."
        for i, (g, w) in enumerate(zip(got, want)):
            if not _same(g, w, atol):
                return _difference(g, w, atol, f"part {i} of the result")
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where} should be a torch.Tensor, got a {type(got).__name__}."
        if got.shape != want.shape:
            return f"{where} has shape {tuple(got.shape)}; expected {tuple(want.shape)}."
        if got.dtype != want.dtype and (not want.is_floating_point() or not got.is_floating_point()):
            return f"{where} has dtype {got.dtype}; expected {want.dtype}."
        if not want.is_floating_point() and want.numel():
            lo, hi = int(want.min()), int(want.max())
            glo, ghi = int(got.min()), int(got.max())
            if glo < lo or ghi > hi:
                return f"{where} spans [{glo}, {ghi}]; the reference stays within [{lo}, {hi}]."
        diff = (got.double() - want.double()).abs()
        i = int(diff.argmax())
        return (f"{where} differs from the reference by up to {float(diff.max()):.3g} "
                f"(first at flat index {i}: {got.flatten()[i].item()!r} vs {want.flatten()[i].item()!r}).")
    return f"{where} is {got!r}; expected {want!r}."


class Exercise:
    """Run the reader's function on ``cases`` and compare with ``reference``.

    ``mistakes`` maps an explanation to a buggy implementation that makes that
    mistake; the first one whose outputs the reader's function reproduces on
    every case is named in the feedback.
    """

    def __init__(self, name: str, reference: Callable, cases: Sequence[tuple], *,
                 mistakes: dict[str, Callable] | None = None, atol: float = 1e-6):
        if not cases:
            raise ValueError("an exercise needs at least one test case")
        if isinstance(atol, bool) or not isinstance(atol, int | float) or not 0 <= atol < math.inf:
            raise ValueError(f"atol must be a finite number >= 0, got {atol!r}")
        if not callable(reference):
            raise TypeError(f"reference must be a function, got {type(reference).__name__}")
        self.name, self.reference, self.cases = name, reference, list(cases)
        self.mistakes, self.atol = dict(mistakes or {}), atol

    def _outputs(self, fn):
        return [fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in case]) for case in self.cases]

    def check(self, fn: Callable) -> Feedback:
        if not callable(fn):
            return Feedback(False, f"Pass your function itself, got {type(fn).__name__}.")
        name = getattr(fn, "__name__", None) or type(fn).__name__  # a functools.partial has no __name__
        try:
            got = self._outputs(fn)
        except NotImplementedError:
            return Feedback(False, f"`{name}` is not written yet.")
        except SystemExit:  # exit() in the reader's code would end the kernel's cell, not answer the exercise
            return Feedback(False, f"`{name}` called exit(); return a result instead.")
        except Exception as e:  # the reader's code: report, don't crash the notebook
            return Feedback(False, f"`{name}` raised {type(e).__name__}: {e}")
        want = self._outputs(self.reference)
        if all(_same(g, w, self.atol) for g, w in zip(got, want)):
            return Feedback(True, f"{self.name}: all {len(self.cases)} cases match the reference.")
        for msg, bug in self.mistakes.items():
            if all(_same(g, b, self.atol) for g, b in zip(got, self._outputs(bug))):
                return Feedback(False, msg)
        bad = next(i for i, (g, w) in enumerate(zip(got, want)) if not _same(g, w, self.atol))
        return Feedback(False, f"{self.name}, case {bad}: {_difference(got[bad], want[bad], self.atol)}")


class Solution:
    """A worked solution behind a reveal: ``Solution(fn)`` shows its source folded ("Show the solution")."""

    def __init__(self, fn: Callable, title: str = "Show the solution"):
        import inspect

        if not callable(fn):
            raise ValueError(f"Solution takes a function, got {type(fn).__name__}")
        self.source, self.title = inspect.getsource(fn), title

    def _repr_html_(self):
        import html

        return (f"<details class='kvlab-solution'><summary>{html.escape(self.title)}</summary>"
                f"<pre><code>{html.escape(self.source)}</code></pre></details>")


LEDGER: dict[str, None] = {}  # every claim checked in this kernel, in order (a chapter's ledger)


def record(names) -> None:
    """Note claims that held (for :func:`ledger`)."""
    for n in names:
        LEDGER[str(n)] = None


def ledger_html() -> str:
    import html

    items = "".join(f"<li>{html.escape(c)}</li>" for c in LEDGER)
    return (f"<details class='kvlab-ledger'><summary>✓ {len(LEDGER)} claims in this chapter checked against "
            f"its data</summary><ul>{items}</ul></details>")


def ledger() -> None:
    """One collapsed line at the end of a chapter: how many of its claims were checked against the data,
    with the list behind a click. The checks themselves print nothing; a failing one stops the chapter."""
    from IPython.display import HTML, display

    display(HTML(ledger_html()))


def claims(checks: dict[str, object], *, show: bool = False) -> None:
    """Check every claim of a paragraph; raise ``AssertionError`` naming each one the data no longer supports.

    ``checks`` maps a claim, in words, to a truth value, or to ``(truth, detail)`` where
    ``detail`` (the numbers involved) goes into the error. Silent when all hold (they join the
    chapter's :func:`ledger`; ``show=True`` prints a line); returns nothing.
    """
    if not isinstance(checks, dict) or not checks:
        raise ValueError("claims takes a non-empty dict {claim in words: truth or (truth, detail)}")
    failed = []
    for claim, value in checks.items():
        truth, detail = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
        try:
            ok = holds(truth)
        except (TypeError, RuntimeError, ValueError) as e:  # e.g. a tensor of many elements
            raise ValueError(f"claim {claim!r}: its value must be true or false, got {type(truth).__name__}") from e
        if not ok:
            failed.append(claim + ("" if detail is None else f" (got {detail})"))
    if failed:
        raise AssertionError("the data no longer supports: " + "; ".join(failed) + ". Update the text above.")
    record(checks)
    if show:
        print(f"✓ {len(checks)} claim{'s' if len(checks) != 1 else ''} checked against the data")
