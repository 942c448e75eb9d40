import pytest
import torch

from kvlab.check import Exercise, MultipleChoice, Numeric, claims


def test_multiple_choice():
    q = MultipleChoice("2+2?", {"4": "Yes.", "5": "Off by one."}, answer="4")
    assert q.check("4").correct and q.check(0).correct
    fb = q.check("5")
    assert not fb.correct and fb.message == "Off by one."
    with pytest.raises(ValueError, match="not one of the choices"):
        q.check("6")
    with pytest.raises(ValueError, match="answer"):
        MultipleChoice("?", {"a": "", "b": ""}, answer="c")


def test_numeric_tolerance_and_named_mistakes():
    q = Numeric("bytes?", 131072, rel_tol=0.01, mistakes={"You forgot V.": 65536})
    assert q.check(131072).correct and q.check("131500").correct
    assert q.check(65536).message == "You forgot V."
    assert "2x" in q.check(262144).message
    assert not q.check("lots").correct


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
    assert "case 0 differs" in ex.check(lambda x: x.to(torch.int8)).message
    assert not ex.check("not a function").correct


def test_widgets_build():
    q = MultipleChoice("?", {"a": "A", "b": "B"}, answer="a")
    box = q.widget()
    radio, button, out = box.children[1].children
    button.click()
    assert "Pick an answer" in out.value
    radio.value = "b"
    button.click()
    assert "Not yet" in out.value and "B" in out.value
    radio.value = "a"
    button.click()
    assert "Correct" in out.value

    n = Numeric("how many?", 3).widget()
    box, button, out = n.children[1].children
    box.value = 3.0
    button.click()
    assert "Correct" in out.value


def test_claims_names_what_fails(capsys):
    assert claims({"two is more than one": 2 > 1, "a tensor compare": torch.tensor(True)}) == 2
    assert "2 claims checked" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"one is more than two \(got 1 vs 2\); zero is true\. Update"):
        claims({"fine": True, "one is more than two": (1 > 2, "1 vs 2"), "zero is true": 0})
    with pytest.raises(ValueError, match="true or false"):
        claims({"many": torch.ones(3)})
    with pytest.raises(ValueError, match="non-empty"):
        claims({})
