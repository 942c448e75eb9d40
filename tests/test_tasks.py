import random

import pytest

from kvlab import tasks


class CharTok:
    """A stand-in tokenizer: one token per character (so lengths are easy to reason about)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


@pytest.mark.parametrize("length", [200, 257, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_exact_length_and_depth(length, depth):
    tok = CharTok()
    ex = tasks.passkey(tok, length, depth, random.Random(0), key="12345")
    assert len(ex.input_ids) == length
    text = "".join(map(chr, ex.input_ids))
    assert text.count("12345") == 1 and text.endswith(tasks.QUESTION)
    assert "".join(map(chr, ex.answer_ids)) == " 12345"
    assert text[ex.needle_start:].startswith(tasks.NEEDLE.format(key="12345"))
    hay = length - len(tasks.INTRO) - len(tasks.NEEDLE.format(key="12345")) - len(tasks.QUESTION)
    placed = (ex.needle_start - len(tasks.INTRO)) / hay
    assert abs(placed - depth) < 0.05 + 25 / hay  # within one filler sentence of the requested depth


def test_passkey_errors():
    with pytest.raises(ValueError, match="too short"):
        tasks.passkey(CharTok(), 50, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="depth"):
        tasks.passkey(CharTok(), 500, 1.5, random.Random(0))


def test_kv_lookup_weights_mark_answers():
    ids, w = tasks.kv_lookup(CharTok(), 600, random.Random(1), n_pairs=4, n_queries=2)
    assert len(ids) == len(w) == 600
    marked = "".join(chr(i) for i, x in zip(ids, w) if x)
    assert len(marked) == 2 * 7  # " 12345." twice
    assert all(c.isdigit() or c in " ." for c in marked)


def test_variable_chain_exact_length_and_answer():
    tok = CharTok()
    ex = tasks.variable_chain(tok, 800, 0.5, random.Random(3), hops=2, key="55555")
    assert len(ex.input_ids) == 800
    a, b, c = ex.meta["names"]
    text = "".join(map(chr, ex.input_ids))
    assert f" Link {a} {b}." in text and f" Link {b} {c}." in text and f" Value {c} 55555." in text
    assert text.endswith(f" Trace {a}:") and ex.answer == f"{b} {c} 55555."
    with pytest.raises(ValueError, match="hops"):
        tasks.variable_chain(tok, 800, 0.5, random.Random(3), hops=0)


class WordTok(CharTok):
    """Characters, with a transformers-style id -> token string map (for sentence boundaries)."""

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_in_a_prose_haystack(depth):
    tok = WordTok()
    prose = tasks.prose_tokens(tok, "First sentence here. Second one follows! A third? " * 40)
    ex = tasks.passkey(tok, 600, depth, random.Random(1), key="24680", haystack=prose)
    text = "".join(map(chr, ex.input_ids))
    assert len(ex.input_ids) == 600 and text.endswith(tasks.QUESTION) and text.count("24680") == 1
    before = text[: ex.needle_start]
    assert before.endswith((".", "!", "?", "\n")), "the needle goes on a sentence boundary"
    assert "Second one" in text, "the haystack is the given prose, not filler"
    with pytest.raises(ValueError, match="haystack has"):
        tasks.passkey(tok, 600, depth, random.Random(1), haystack=prose[:100])


def test_shipped_prose_is_long_enough_for_8k_prompts():
    assert len(tasks.prose_tokens(CharTok())) > 100_000


def test_heldout_windows_cut_consecutive_windows():
    from kvlab.tasks import heldout_windows

    tok = lambda text: [ord(c) for c in text]  # a tokenizer that is a function: one token a character
    w = heldout_windows(tok, "abcdefghij", window=3, max_windows=10)
    assert w == [[97, 98, 99], [100, 101, 102], [103, 104, 105]]  # the last window needs one token after it
    assert heldout_windows(tok, "abcdefghij", window=3, max_windows=2) == w[:2]
    with pytest.raises(ValueError, match="fewer than window"):
        heldout_windows(tok, "abc", window=3)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        heldout_windows(tok, "abcdef", window=0)


@pytest.mark.parametrize("keys", [2, 4])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_multikey_places_every_named_key_once_and_asks_for_the_one_at_depth(keys, depth):
    ex = tasks.multikey(CharTok(), 1200, depth, random.Random(3), keys=keys)
    text = "".join(map(chr, ex.input_ids))
    assert len(ex.input_ids) == 1200 and len(set(ex.meta["keys"])) == keys
    asked, key = ex.meta["names"][0], ex.meta["keys"][0]
    assert ex.answer == key and "".join(map(chr, ex.answer_ids)) == " " + key
    assert text.endswith(tasks.MULTI_QUESTION.format(name=asked))
    for name, k in zip(ex.meta["names"], ex.meta["keys"]):
        assert text.count(tasks.MULTI_NEEDLE.format(name=name, key=k)) == 1 and text.count(k) == 1
    assert text[ex.needle_start:].startswith(tasks.MULTI_NEEDLE.format(name=asked, key=key))
    needles = sum(len(tasks.MULTI_NEEDLE.format(name=n, key=k)) for n, k in zip(ex.meta["names"], ex.meta["keys"]))
    hay = 1200 - len(tasks.MULTI_INTRO) - needles - len(tasks.MULTI_QUESTION.format(name=asked))
    before = text[len(tasks.MULTI_INTRO):ex.needle_start]  # haystack before the asked needle, other needles removed
    for name, k in zip(ex.meta["names"][1:], ex.meta["keys"][1:]):
        before = before.replace(tasks.MULTI_NEEDLE.format(name=name, key=k), "")
    assert abs(len(before) / hay - depth) < 0.05 + 25 / hay  # within one filler sentence of the requested depth


@pytest.mark.parametrize("records", [1, 3, 5])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_order_lookup_holds_each_record_once_and_asks_about_the_one_at_depth(records, depth):
    ex = tasks.order_lookup(CharTok(), 2000, depth, random.Random(7), records=records)
    text = "".join(map(chr, ex.input_ids))
    names, order_ids = ex.meta["names"], ex.meta["order_ids"]
    assert len(ex.input_ids) == 2000 and len(set(names)) == len(set(order_ids)) == len(set(ex.meta["cities"])) == records
    assert ex.answer == order_ids[0] and "".join(map(chr, ex.answer_ids)) == order_ids[0]
    assert text.endswith(tasks.ORDER_QUESTION.format(name=names[0])) and text.endswith('{"order_id": "')
    for name, o in zip(names, order_ids):  # each record once, each ID only in its record
        assert text.count(f"Customer: {name}.") == 1 and text.count(o) == 1
    assert text[ex.needle_start:].startswith(f"\n[Order record] Order ID: {order_ids[0]}. Customer: {names[0]}.")
    recs = [tasks.ORDER_RECORD.format(order_id=o, name=n, item=i, city=c)
            for o, n, i, c in zip(order_ids, names, ex.meta["items"], ex.meta["cities"])]
    hay = text[len(tasks.ORDERS_INTRO):len(text) - len(tasks.ORDER_QUESTION.format(name=names[0]))]
    before = text[len(tasks.ORDERS_INTRO):ex.needle_start]
    for r in recs:  # the haystack alone, and the part of it before the asked record
        hay, before = hay.replace(r, ""), before.replace(r, "")
    assert abs(len(before) / len(hay) - depth) < 0.05 + 25 / len(hay)  # within one filler sentence of the depth


def test_order_lookup_errors():
    with pytest.raises(ValueError, match="records must be"):
        tasks.order_lookup(CharTok(), 1000, 0.5, random.Random(0), records=0)
    with pytest.raises(ValueError, match="too short for 3 order records"):
        tasks.order_lookup(CharTok(), 200, 0.5, random.Random(0), records=3)
    with pytest.raises(ValueError, match="depth"):
        tasks.order_lookup(CharTok(), 1000, 1.5, random.Random(0))


def test_multikey_errors():
    with pytest.raises(ValueError, match="keys must be"):
        tasks.multikey(CharTok(), 1000, 0.5, random.Random(0), keys=1)
    with pytest.raises(ValueError, match="too short for a 3-key prompt"):
        tasks.multikey(CharTok(), 100, 0.5, random.Random(0), keys=3)
    with pytest.raises(ValueError, match="depth"):
        tasks.multikey(CharTok(), 1000, -0.1, random.Random(0))
