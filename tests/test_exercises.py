import pytest

from kvlab import exercises as E

EXERCISES = [E.int8_per_token_exercise, E.pack_int4_exercise, E.int4_asym_exercise]


@pytest.mark.parametrize("make", EXERCISES)
def test_reference_passes_and_every_mistake_is_named(make):
    ex = make()
    assert ex.check(ex.reference).correct
    for message, bug in ex.mistakes.items():
        fb = ex.check(bug)
        assert not fb.correct and fb.message == message, f"{message!r} was not diagnosed"


def test_pack_unpack_roundtrip():
    import torch

    codes = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    assert torch.equal(E.unpack_int4(E.pack_int4(codes)), codes)
    from kvlab.quant import pack_int

    assert torch.equal(E.pack_int4(codes), pack_int(codes, 4))  # same convention as the library
