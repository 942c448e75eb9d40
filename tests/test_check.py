import pytest
import torch

from kvlab.check import Exercise, MultipleChoice, Numeric, claims


def test_multiple_choice():
    q = MultipleChoice("2+2?", {"4": "Yes.", "5": "Off by one."}, answer="4")
    assert q.check("4").correct and q.check(q.options.index("4")).correct
    fb = q.check("5")
    assert not fb.correct and fb.message == "Off by one."
    with pytest.raises(ValueError, match="not one of the choices"):
        q.check("6")
    with pytest.raises(ValueError, match="answer"):
        MultipleChoice("?", {"a": "", "b": ""}, answer="c")
    with pytest.raises(ValueError, match="length gives it away"):
        MultipleChoice("?", {"short": "", "the right answer, spelled out at length": ""},
                       answer="the right answer, spelled out at length")


def test_option_order_does_not_follow_the_written_order():
    opts = {f"option {i}": "" for i in range(8)}
    orders = {tuple(MultipleChoice(f"question {k}?", opts, answer="option 0").options) for k in range(6)}
    assert len(orders) > 1, "the displayed order should vary between questions"
    q = MultipleChoice("q?", opts, answer="option 0")
    assert q.options == MultipleChoice("q?", dict(reversed(list(opts.items()))), answer="option 0").options, \
        "the order must not depend on the order the author wrote the options in"


def test_numeric_tolerance_and_named_mistakes():
    q = Numeric("bytes?", 131072, rel_tol=0.01, mistakes={"You forgot V.": 65536})
    assert q.check(131072).correct and q.check("131500").correct
    assert q.check(65536).message == "You forgot V."
    assert "2x" in q.check(262144).message
    assert not q.check("lots").correct


def test_a_numeric_answer_in_the_static_book_carries_its_mistake_hints():
    html = Numeric("bytes?", 131072, mistakes={"You forgot <V>.": 65536})._answer_html()
    assert "<b>65,536</b>: You forgot &lt;V&gt;." in html and "<details>" in html
    assert "<details>" not in Numeric("bytes?", 131072)._answer_html()


def quant_ref(x):
    s = x.abs().amax(-1, keepdim=True) / 127
    return torch.round(x / s).clamp(-127, 127).to(torch.int8)


def quant_wrong_axis(x):
    s = x.abs().amax(-2, keepdim=True) / 127
    return torch.round(x / s).clamp(-127, 127).to(torch.int8)


def test_exercise_accepts_right_and_names_mistake():
    ex = Exercise("int8", quant_ref, [(torch.randn(4, 8),), (torch.randn(3, 16),)],
                  mistakes={"Wrong axis: scales must be per token (last dim).": quant_wrong_axis})
    assert ex.check(quant_ref).correct
    assert ex.check(quant_wrong_axis).message.startswith("Wrong axis")

    def crashes(x):
        raise RuntimeError("boom")

    def todo(x):
        raise NotImplementedError

    assert "RuntimeError: boom" in ex.check(crashes).message
    assert "not written yet" in ex.check(todo).message
    assert "differs from the reference by up to" in ex.check(lambda x: x.to(torch.int8)).message
    assert "dtype torch.float32; expected torch.int8" in ex.check(lambda x: quant_ref(x).float()).message
    assert "shape (4, 1)" in ex.check(lambda x: quant_ref(x)[:, :1]).message
    assert "spans [-128," in ex.check(lambda x: torch.full_like(quant_ref(x), -128)).message
    assert "should be a tuple of 2" in Exercise("t", lambda x: (x, x), [(torch.ones(2),)]).check(lambda x: x).message
    assert not ex.check("not a function").correct


def test_widgets_build():
    q = MultipleChoice("?", {"a": "A", "b": "B"}, answer="a")
    box = q.widget()
    radio, buttons, out = box.children[1].children
    button, reveal = buttons.children
    reveal.click()
    assert "<b>a</b>" in out.value
    button.click()
    assert "Pick an answer" in out.value
    radio.value = "b"
    button.click()
    assert "Not yet" in out.value and "B" in out.value
    radio.value = "a"
    button.click()
    assert "Correct" in out.value

    n = Numeric("how many?", 3).widget()
    box, buttons, out = n.children[1].children
    button = buttons.children[0]
    box.value = 3.0
    button.click()
    assert "Correct" in out.value


def test_claims_names_what_fails(capsys):
    from kvlab import check

    assert claims({"two is more than one": 2 > 1, "a tensor compare": torch.tensor(True)}) is None
    assert capsys.readouterr().out == ""  # silent: the chapter's ledger collects it
    assert "two is more than one" in check.LEDGER
    claims({"shown": True}, show=True)
    assert "1 claim checked" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"one is more than two \(got 1 vs 2\); zero is true\. Update"):
        claims({"fine": True, "one is more than two": (1 > 2, "1 vs 2"), "zero is true": 0 == 1})
    for not_a_truth in (torch.ones(3), 1, 0, float("nan"), [1], "yes", None):  # bool() would say something for each
        with pytest.raises(ValueError, match="true or false"):
            claims({"a number, not a test": not_a_truth})
    with pytest.raises(ValueError, match="non-empty"):
        claims({})


def test_the_ledger_is_one_collapsed_line_listing_every_claim(capsys):
    from kvlab import check

    check.LEDGER.clear()
    claims({"a": True, "b": True})
    claims({"b": True, "c": True})  # a claim checked twice counts once
    html = check.ledger_html()
    assert html.startswith("<details") and "✓ 3 claims in this chapter" in html and html.count("<li>") == 3


def test_quiz_snapshot_shows_each_option_with_its_feedback():
    from kvlab.check import MultipleChoice

    q = MultipleChoice("which?", {"right one": "Yes, because.", "wrong one": "No, because."}, answer="right one")
    assert "<summary>wrong one</summary><p>No, because.</p>" in q.snapshot_html()


def test_a_nan_claim_does_not_hold():
    """bool(nan) is True in Python: a claim whose value became NaN (a ratio of empty counts) must fail, not pass."""
    import math

    from kvlab.check import claims
    from kvlab.facts import Facts

    for bad in (float("nan"), math.inf, -math.inf, 1.0):  # a number is not a truth value: refused, naming the claim
        with pytest.raises(ValueError, match="ratio is positive.*true or false"):
            claims({"the ratio is positive": bad})
        with pytest.raises(TypeError, match="ratio is positive.*true or false"):
            Facts({}, {"the ratio is positive": (bad, 0)})
    claims({"a comparison holds as before": 0.5 > 0})
