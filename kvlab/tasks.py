"""Synthetic long-context tasks, built at the token level so lengths are exact.

Tasks shared by the training script (which teaches the shipped model to
retrieve) and by the evals (which measure whether a KV format lets it):

* **passkey** — a 5-digit key hidden at a chosen depth inside repeated filler
  sentences, then a question. The format follows the passkey test of
  Mohtashami & Jaggi, *Landmark Attention* (2023, arXiv:2305.16300), worded
  afresh here.
* **key-value lookup** — many ``name → number`` facts scattered through a
  haystack, then several questions. Training uses it because many answers per
  sequence give a tiny model enough signal to learn copying from context.
* **variable tracking** (multi-hop) — a chain of links ``a -> b -> c -> number``
  scattered through the haystack; the model must name every hop in order, so
  one wrong lookup derails the rest. After RULER's variable-tracking task
  (Hsieh et al. 2024, arXiv:2404.06654), simplified.

The passkey wording avoids the word "is" everywhere but at the question's end
and the needle, so the lookup is one unambiguous match: a small model learns it.

Every piece of text starts with a space or a newline, so concatenating the
token lists of pieces gives the same ids as tokenizing the joined string
(byte-level BPE splits before a space). That lets us hit an exact token count.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from .paths import CORPUS_DIR

INTRO = "\nA special number hides somewhere in the long text below. Find it and remember it."
FILLER = (
    " The grass grows green.",
    " The sky looks blue.",
    " The sun shines yellow.",
    " Here we go.",
    " There and back again.",
)
NEEDLE = " The pass key is {key}. Remember it."
QUESTION = " Which number was hidden? The pass key is"

NAMES = (
    "apple amber anchor arrow aspen badge basil beacon birch bison breeze bronze cabin cactus "
    "canyon cedar cherry cinder clover cobalt comet copper coral crater daisy delta desert "
    "dune eagle ember falcon fern flint forest fossil galaxy garnet glacier granite harbor "
    "hazel heron indigo island ivory jasmine jungle kernel lagoon lantern lemon lilac lotus "
    "magnet maple marble meadow mercury meteor mint monsoon nebula nectar oasis ocean olive "
    "onyx orbit orchid otter panda pebble pepper pillar pine planet plum prairie quartz "
    "raven reef river robin ruby saffron salmon sapphire shadow silver spruce summit "
    "thistle thunder tiger topaz tulip tundra valley velvet violet walnut willow zephyr"
).split()


@dataclass
class Example:
    """One prompt: ``input_ids`` end right before the answer; ``answer_ids`` follow it."""

    input_ids: list[int]
    answer_ids: list[int]
    answer: str
    needle_start: int = -1  # token index where the needle sentence begins
    meta: dict = field(default_factory=dict)


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) if hasattr(tok, "encode") else tok(text)


def bos(tok) -> list[int]:
    """The tokens the tokenizer puts before a text (Gemma's ``<bos>``; none for SmolLM2 or kvlab-tiny)."""
    return tok.encode("", add_special_tokens=True) if hasattr(tok, "encode") else []


def key_lookalikes(text: str, digits: int = 5) -> int:
    """How many ``digits``-digit numbers a haystack already holds: a model asked for the key may copy one of them
    (a haystack cut from order records or invoices is full of them), which the eval would count as a miss."""
    return len(re.findall(rf"(?<!\d)\d{{{digits}}}(?!\d)", text))


def random_key(rng: random.Random, digits: int = 5) -> str:
    first = str(rng.randint(1, 9))
    return first + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))


def filler_tokens(tok, n: int) -> list[int]:
    """Exactly ``n`` tokens of filler: whole sentences in a fixed cycle, the last one cut."""
    pieces = [_encode(tok, s) for s in FILLER]
    out: list[int] = []
    i = 0
    while len(out) < n:
        out.extend(pieces[i % len(pieces)])
        i += 1
    return out[:n]


def _boundaries(tok, hay: list[int]) -> list[int]:
    """Indices in ``hay`` where a sentence (or line) has just ended: safe places for a needle."""
    words = tok.convert_ids_to_tokens(hay) if hasattr(tok, "convert_ids_to_tokens") else [chr(i) for i in hay]
    ends = [i + 1 for i, w in enumerate(words) if w and w.rstrip("Ġ ").endswith((".", "\n", "Ċ", "!", "?"))]
    return [0, *ends]


CORPUS_SOURCE = ("English docstrings of CPython's standard library (Python Software Foundation License), "
                 "collected by scripts/build_corpus.py")


def corpus_text(split: str = "heldout") -> str:
    """The project's English corpus (:data:`CORPUS_SOURCE`): ``"heldout"`` (every 10th module), ``"train"`` or ``"all"``."""
    import gzip

    if split not in ("heldout", "train", "all"):
        raise ValueError(f"split must be 'heldout', 'train' or 'all', got {split!r}")
    parts = ("heldout", "train") if split == "all" else (split,)
    return "\n".join(gzip.open(CORPUS_DIR / f"{p}.txt.gz", "rt").read() for p in parts)


def heldout_windows(tok, text: str | None = None, window: int = 512, max_windows: int = 16) -> list[list[int]]:
    """Consecutive ``window``-token windows of held-out text (the project's corpus by default), at most
    ``max_windows``: the text both perplexity rungs read (:func:`kvlab.evals.perplexity` in process,
    :func:`kvlab.endpoint.perplexity` through a server)."""
    for name, v in (("window", window), ("max_windows", max_windows)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    ids = _encode(tok, corpus_text("heldout") if text is None else text)
    if len(ids) < window + 1:
        raise ValueError(f"text has {len(ids)} tokens, fewer than window + 1 = {window + 1}")
    return [ids[s : s + window] for s in range(0, len(ids) - window, window)[:max_windows]]


def prose_tokens(tok, text: str | None = None) -> list[int]:
    """English text as one token list, to cut haystacks from (the project's held-out corpus by default)."""
    if text is None:
        text = corpus_text("heldout")
    return _encode(tok, "\n" + text.replace("\n\n", "\n"))


def passkey(tok, length: int, depth: float, rng: random.Random, key: str | None = None,
            haystack: list[int] | None = None) -> Example:
    """A passkey prompt of exactly ``length`` tokens with the needle at ``depth`` (0 = start, 1 = end).

    The haystack is repeated filler sentences by default; pass ``haystack`` (a token
    list such as :func:`prose_tokens`) to cut it from real text instead, at a random
    offset drawn from ``rng``. The needle is placed on a sentence boundary as close as
    possible to ``depth`` of the way through the haystack.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    key = key or random_key(rng)
    intro, question = bos(tok) + _encode(tok, INTRO), _encode(tok, QUESTION)
    needle = _encode(tok, NEEDLE.format(key=key))
    answer = _encode(tok, " " + key)
    n_fill = length - len(intro) - len(needle) - len(question)
    if n_fill < 0:
        raise ValueError(
            f"length={length} is too short for a passkey prompt: it needs at least "
            f"{len(intro) + len(needle) + len(question)} tokens"
        )
    hay, bounds = _haystack(tok, n_fill, rng, haystack, length)
    cut = min(bounds, key=lambda b: abs(b - depth * n_fill))
    ids = intro + hay[:cut] + needle + hay[cut:] + question
    assert len(ids) == length
    return Example(ids, answer, key, needle_start=len(intro) + cut, meta={"depth": depth})


def _haystack(tok, n_fill: int, rng: random.Random, haystack: list[int] | None, length: int):
    """``n_fill`` haystack tokens and the sentence boundaries inside them (a needle never splits a sentence):
    repeated filler sentences, or a stretch of ``haystack`` at an offset drawn from ``rng``."""
    if haystack is None:
        hay = filler_tokens(tok, n_fill)
        bounds, pos, i = [0], 0, 0
        lens = [len(_encode(tok, s)) for s in FILLER]
        while pos < n_fill:
            pos += lens[i % len(lens)]
            i += 1
            if pos <= n_fill:
                bounds.append(pos)
        return hay, bounds
    if len(haystack) < n_fill:
        raise ValueError(f"haystack has {len(haystack)} tokens; a {length}-token prompt needs {n_fill}")
    start = rng.randrange(0, len(haystack) - n_fill + 1)
    hay = list(haystack[start : start + n_fill])
    return hay, _boundaries(tok, hay)


def _place(tok, intro: list[int], needles: list[list[int]], question: list[int], length: int, depth: float,
           rng: random.Random, haystack: list[int] | None, what: str) -> tuple[list[int], int]:
    """``intro``, a haystack holding ``needles``, then ``question``: exactly ``length`` tokens. The first needle
    (the one asked about) sits on the sentence boundary nearest ``depth``, the others on random boundaries.
    Returns the ids and where the first needle starts."""
    n_fill = length - len(intro) - sum(map(len, needles)) - len(question)
    if n_fill < 0:
        raise ValueError(f"length={length} is too short for {what}: it needs at least {length - n_fill} tokens")
    hay, bounds = _haystack(tok, n_fill, rng, haystack, length)
    target = min(bounds, key=lambda b: abs(b - depth * n_fill))
    others = [b for b in bounds if b != target] or [target]
    cuts = [target] + [rng.choice(others) for _ in needles[1:]]
    ids, start, prev = list(intro), -1, 0
    for i in sorted(range(len(needles)), key=lambda i: (cuts[i], i)):  # needles in haystack order
        ids += hay[prev:cuts[i]]
        if i == 0:
            start = len(ids)
        ids += needles[i]
        prev = cuts[i]
    ids += hay[prev:] + question
    assert len(ids) == length
    return ids, start


# the harder rungs' defaults, as chapter 4's sweeps ran them: named keys in a multi-key prompt, records in an order lookup
MULTIKEY_KEYS, ORDER_RECORDS = 2, 3

MULTI_INTRO = "\nSeveral pass keys hide in the long text below, each with a name. Find them and remember them."
MULTI_NEEDLE = " The pass key for {name} is {key}."
MULTI_QUESTION = " What is the pass key for {name}? The pass key for {name} is"


def multikey(tok, length: int, depth: float, rng: random.Random, keys: int = MULTIKEY_KEYS,
             haystack: list[int] | None = None) -> Example:
    """A harder passkey prompt (RULER's multi-key needle, Hsieh et al. 2024, arXiv:2404.06654): ``keys``
    named pass keys in the haystack, the one asked for at ``depth`` and the others at random sentence
    boundaries; the model must return the asked one's key, not a neighbour's. Exactly ``length`` tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    if isinstance(keys, bool) or not isinstance(keys, int) or not 2 <= keys <= 20:
        raise ValueError(f"keys must be an integer from 2 to 20, got {keys!r}")
    names = rng.sample(NAMES, keys)
    values: list[str] = []
    while len(values) < keys:  # distinct keys: an answer names exactly one needle
        if (k := random_key(rng)) not in values:
            values.append(k)
    intro, question = bos(tok) + _encode(tok, MULTI_INTRO), _encode(tok, MULTI_QUESTION.format(name=names[0]))
    needles = [_encode(tok, MULTI_NEEDLE.format(name=n, key=k)) for n, k in zip(names, values)]
    ids, start = _place(tok, intro, needles, question, length, depth, rng, haystack, f"a {keys}-key prompt")
    return Example(ids, _encode(tok, " " + values[0]), values[0], needle_start=start,
                   meta={"depth": depth, "names": names, "keys": values})


ORDERS_INTRO = ("\nA support assistant's context: order records returned by a search, among other retrieved "
                "documents. Answer the request at the end with a tool call.")
ORDER_RECORD = "\n[Order record] Order ID: {order_id}. Customer: {name}. Item: {item}. Ships from: {city}."
ORDER_QUESTION = ("\n\nUser: Please cancel {name}'s order.\nAssistant: "
                  '{{"name": "cancel_order", "arguments": {{"order_id": "')
CUSTOMERS = ("Alice Moreno", "Bruno Keller", "Chen Wei", "Dana Okafor", "Elif Demir", "Farid Haddad", "Greta Lind",
             "Hiro Tanaka", "Ines Duarte", "Jonas Berg", "Kavya Rao", "Luca Ferri", "Maya Cohen", "Nils Olsen",
             "Omar Aziz", "Paula Reyes", "Quinn Walsh", "Rosa Varga", "Sami Nieminen", "Tara Singh")
ITEMS = ("a desk lamp", "two office chairs", "a coffee grinder", "a wool blanket", "a bicycle pump", "a rain jacket",
         "a pair of boots", "a kettle", "a bookshelf", "a camping stove", "a monitor stand", "a garden hose")
CITIES = ("Lisbon", "Oslo", "Denver", "Nairobi", "Osaka", "Quito", "Dublin", "Perth", "Seville", "Montreal", "Hanoi",
          "Cairo", "Krakow", "Lima", "Boston", "Madrid", "Vienna", "Austin", "Manila", "Bergen")


def order_lookup(tok, length: int, depth: float, rng: random.Random, records: int = ORDER_RECORDS,
                 haystack: list[int] | None = None) -> Example:
    """A product-like rung: a support assistant's retrieved context, ``records`` order records (a 5-digit order
    ID, customer, item, warehouse city) among other documents, a user asking to cancel one customer's order, and
    the assistant's tool call cut off where its JSON argument begins: the answer is that order's ID. The asked
    record sits at ``depth``, the others at random sentence boundaries; every record has its own customer, city
    and ID, so the answer names exactly one record. Exactly ``length`` tokens.

    Unlike the passkey, the model must pick one record among look-alikes by a name (as in question answering over
    several retrieved passages, Liu et al. 2023, "Lost in the Middle", arXiv:2307.03172) and copy a field into a
    tool call's arguments; the haystack is real text when ``haystack`` is given. The ID has several digits, so in a
    full-precision prefill all but the first answer token read the quantized cache (a one-token answer, such as
    a city, would be decided by the prefill alone)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    if isinstance(records, bool) or not isinstance(records, int) or not 1 <= records <= len(CUSTOMERS):
        raise ValueError(f"records must be an integer from 1 to {len(CUSTOMERS)}, got {records!r}")
    names, cities = rng.sample(CUSTOMERS, records), rng.sample(CITIES, records)
    items = [rng.choice(ITEMS) for _ in range(records)]
    ids_: list[str] = []
    while len(ids_) < records:  # distinct IDs: an answer names exactly one record
        if (k := random_key(rng)) not in ids_:
            ids_.append(k)
    intro = bos(tok) + _encode(tok, ORDERS_INTRO)
    question = _encode(tok, ORDER_QUESTION.format(name=names[0]))
    needles = [_encode(tok, ORDER_RECORD.format(order_id=o, name=n, item=i, city=c))
               for o, n, i, c in zip(ids_, names, items, cities)]
    ids, start = _place(tok, intro, needles, question, length, depth, rng, haystack, f"{records} order records")
    return Example(ids, _encode(tok, ids_[0]), ids_[0], needle_start=start,
                   meta={"depth": depth, "names": names, "items": items, "cities": cities, "order_ids": ids_})


def kv_lookup(
    tok,
    length: int,
    rng: random.Random,
    n_pairs: int = 8,
    n_queries: int = 4,
    haystack: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """A training sequence of ``length`` tokens: facts scattered in a haystack, then queries.

    Returns ``(ids, weights)`` where ``weights[i]`` is 1 on answer digits (the
    targets that need retrieval) and 0 elsewhere. ``haystack`` is a token list to
    draw background text from (e.g. real prose); filler sentences otherwise.
    """
    names = rng.sample(NAMES, n_pairs)
    keys = [random_key(rng) for _ in names]
    # The query ends with the name, so finding the fact is a match on one token (associative recall).
    facts = [_encode(tok, f" The code of {n} {k}.") for n, k in zip(names, keys)]
    queries = []
    for j in rng.sample(range(n_pairs), min(n_queries, n_pairs)):
        q = _encode(tok, f" Recall the code of {names[j]}")
        a = _encode(tok, " " + keys[j] + ".")
        queries.append((q, a))
    q_len = sum(len(q) + len(a) for q, a in queries)
    n_bg = length - q_len - sum(len(f) for f in facts)
    if n_bg < 0:
        raise ValueError(f"length={length} is too short for {n_pairs} pairs and {n_queries} queries")
    if haystack is None:
        bg = filler_tokens(tok, n_bg)
    else:
        start = rng.randrange(0, max(1, len(haystack) - n_bg))
        bg = haystack[start : start + n_bg]
    cuts = sorted(rng.randrange(0, n_bg + 1) for _ in facts)
    ids: list[int] = []
    prev = 0
    for c, f in zip(cuts, facts):
        ids += bg[prev:c] + f
        prev = c
    ids += bg[prev:]
    weights = [0.0] * len(ids)
    for q, a in queries:
        ids += q + a
        weights += [0.0] * len(q) + [1.0] * len(a)
    return ids[:length], weights[:length]


def variable_chain(tok, length: int, depth_spread: float, rng: random.Random, hops: int = 2,
                   key: str | None = None) -> Example:
    """A multi-hop prompt of exactly ``length`` tokens: ``hops`` links then a value, scattered.

    Facts read ``" Link a b."`` (a points to b) and ``" Value c 12345."``; the
    question ``" Trace a:"`` must be answered ``" b c 12345."``. The facts are
    placed in random order at random depths within the first ``depth_spread``
    fraction of the haystack.
    """
    if not 1 <= hops < len(NAMES):
        raise ValueError(f"hops must be from 1 to {len(NAMES) - 1} (one name a link), got {hops}")
    if not 0.0 < depth_spread <= 1.0:
        raise ValueError(f"depth_spread must be in (0, 1], got {depth_spread!r}")
    key = key or random_key(rng)
    names = rng.sample(NAMES, hops + 1)
    facts = [_encode(tok, f" Link {a} {b}.") for a, b in zip(names, names[1:])]
    facts.append(_encode(tok, f" Value {names[-1]} {key}."))
    rng.shuffle(facts)
    intro = bos(tok) + _encode(tok, "\nFollow the links in the text below from the first name to its number.")
    question = _encode(tok, f" Trace {names[0]}:")
    answer_text = "".join(f" {n}" for n in names[1:]) + f" {key}."
    answer = _encode(tok, answer_text)
    n_fill = length - len(intro) - sum(map(len, facts)) - len(question)
    if n_fill < 0:
        raise ValueError(f"length={length} is too short for a {hops}-hop chain: it needs at least "
                         f"{length - n_fill} tokens")
    hay = filler_tokens(tok, n_fill)
    cuts = sorted(rng.randrange(0, int(depth_spread * n_fill) + 1) for _ in facts)
    ids, prev = list(intro), 0
    for c, f in zip(cuts, facts):
        ids += hay[prev:c] + f
        prev = c
    ids += hay[prev:] + question
    assert len(ids) == length
    return Example(ids, answer, answer_text.strip(), meta={"hops": hops, "names": names})


def sweep_prompts(make, tok, length: int, depth: float, trials: int, seed: int = 0) -> list:
    """The ``trials`` prompts a sweep uses at one (length, depth): every format, and every engine compared
    with kvlab (``scripts/compare_engines.py``), sees exactly these. ``make`` is e.g. :func:`passkey`."""
    rng = random.Random(f"{seed}-{length}-{float(depth)}")  # 0 and 0.0 give the same prompts
    return [make(tok, length, depth, rng) for _ in range(trials)]
