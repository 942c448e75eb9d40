"""A trace-driven simulator of one serving replica with a paged, prefix-cached KV pool.

What it models, and where each piece comes from:

* **The pool.** GPU memory x utilization, minus the weights (:func:`kvlab.budget.fit`),
  cut into blocks of ``block_size`` tokens; a block's bytes are ``block_size`` x the
  model's bytes per token in the chosen KV format. A smaller format means more blocks.
* **Prefix caching** as in vLLM's automatic prefix caching: a full block is identified
  by a hash of its tokens chained on the hash of everything before it, so equal hashes
  mean equal prefixes. Blocks of running requests are pinned (reference-counted);
  finished requests' blocks stay cached until space is needed, then the least
  recently used unreferenced block is evicted first.
* **Scheduling.** Requests arrive by timestamp and wait in FIFO order. A request is
  admitted when the blocks it may need (prompt plus output) are free or evictable; its
  cached prompt prefix is reused and only the rest is prefilled. Decode then extends
  its blocks one token per step; every full block it writes is hashed and cacheable.
* **Time.** Each engine step prefills the newly admitted requests' uncached tokens and
  decodes one token for every running request. Its duration follows a deliberately
  simple cost model (:class:`CostModel`): prefill is compute-bound, decode is
  bandwidth-bound (weights plus every running sequence's cache read once per step).

Outputs: per request, prompt tokens found in cache, tokens recomputed, time queued; in
aggregate, hit rate, prefill tokens saved, peak and mean concurrency, throughput, and
cost per million tokens for a GPU-hour price.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from . import budget as B
from .roofline import MBU, MFU, compute_seconds, memory_seconds


@dataclass
class Request:
    """One request: arrival time (s), prompt block hashes and lengths."""

    arrival: float
    prompt_len: int
    output_len: int
    prompt_hashes: list[int]  # one per *full* prompt block, chained
    output_hashes: list[int] | None = None  # hashes of full blocks of prompt+output, past the prompt's
    rid: int = 0
    block_size: int | None = None  # tokens per hashed block (None: not recorded)

    def __post_init__(self):
        a = self.arrival
        if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a):
            raise ValueError(f"arrival must be a finite number of seconds, got {a!r}")
        for name in ("prompt_len", "output_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a whole number of tokens >= 0, got {v!r}")
        bs = self.block_size
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
            raise ValueError(f"block_size must be a positive integer or None, got {bs!r}")
        if not isinstance(self.prompt_hashes, list):
            raise TypeError(f"prompt_hashes must be a list, got {type(self.prompt_hashes).__name__}")
        if bs and len(self.prompt_hashes) > self.prompt_len // bs:
            raise ValueError(f"{len(self.prompt_hashes)} prompt block hashes for {self.prompt_len} tokens in blocks "
                             f"of {bs}: at most {self.prompt_len // bs}")


def block_hashes(tokens: list[int], block_size: int, parent: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (a trailing partial block is not hashed)."""
    out, h = [], parent
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[i : i + block_size])))
        out.append(h)
    return out


def request_from_tokens(arrival, prompt: list[int], output: list[int], block_size: int, rid=0) -> Request:
    ph = block_hashes(prompt, block_size)
    full = block_hashes(prompt + output, block_size)
    return Request(arrival, len(prompt), len(output), ph, full[len(ph):], rid, block_size)


# --------------------------------------------------------------------------- cost model


@dataclass(frozen=True)
class CostModel:
    """Step time = prefill FLOPs / (peak x MFU) + (weights + cache read) / (bandwidth x MBU), with
    :mod:`kvlab.roofline`'s two formulas. The two terms add (a step runs its prefill chunk, then its
    decode read) where :func:`kvlab.roofline.step_seconds` overlaps them: a conservative serving step.

    Defaults: 2 FLOPs per parameter per prefilled token at 50% of dense BF16 peak, and
    decode reading all weights plus every running sequence's cache at 70% of peak
    bandwidth. Round numbers chosen to be plausible, not measured; the comparisons
    between KV formats depend on them far less than absolute throughput does.
    """

    params: int
    weights_bytes: int
    peak_flops: float
    bandwidth: float
    mfu: float = MFU  # kvlab.roofline: the workbook's efficiency assumptions
    mbu: float = MBU

    def __post_init__(self):
        for name in ("params", "weights_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 60:
                raise ValueError(f"{name} must be a non-negative integer of at most 2**60, got {str(v)[:30]}")
        for name, zero_ok in (("peak_flops", True), ("bandwidth", False)):  # 0 FLOP/s: no peak listed, prefill untimed
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (v == 0 and zero_ok or 1 <= v <= 1e21):
                raise ValueError(f"{name} must be a number from 1 to 1e21 a second{' (or 0: none listed)' * zero_ok}, "
                                 f"got {str(v)[:30]}")
        for name in ("mfu", "mbu"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 1:
                raise ValueError(f"{name} must be a fraction of peak in (0, 1], got {v!r}")

    def step_seconds(self, prefill_tokens: int, decode_cache_bytes: float, decoding: bool) -> float:
        if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int) or not 0 <= prefill_tokens <= 1 << 40:
            raise ValueError(f"prefill_tokens must be a whole number from 0 to 2**40, got {str(prefill_tokens)[:30]}")
        if isinstance(decode_cache_bytes, bool) or not isinstance(decode_cache_bytes, int | float) or \
                not 0 <= decode_cache_bytes <= 2.0 ** 60:
            raise ValueError(f"decode_cache_bytes must be a number of bytes from 0 to 2**60, got {str(decode_cache_bytes)[:30]}")
        t = compute_seconds(2 * self.params * prefill_tokens, self.peak_flops, self.mfu)
        if decoding:
            t += memory_seconds(self.weights_bytes + decode_cache_bytes, self.bandwidth, self.mbu)
        return t


# --------------------------------------------------------------------------- the pool


class BlockPool:
    """Fixed number of blocks; cached blocks by hash; LRU eviction of unreferenced ones."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free = num_blocks  # never-used or released uncached blocks
        self.ref: dict[int, int] = {}  # hash -> reference count, for cached blocks in use
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, oldest first
        self.anon_in_use = 0  # blocks without a hash (partial blocks) held by running requests

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    def available(self) -> int:
        return self.free + len(self.lru)

    def lookup_prefix(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h in self.ref or h in self.lru:
                n += 1
            else:
                break
        return n

    def _take_one(self) -> None:
        if self.free:
            self.free -= 1
        elif self.lru:
            self.lru.popitem(last=False)  # evict the least recently used
        else:
            raise RuntimeError("no block free or evictable (the scheduler reserved wrongly)")

    def acquire_cached(self, h: int) -> None:
        if h in self.lru:
            del self.lru[h]
            self.ref[h] = 1
        else:
            self.ref[h] += 1

    def acquire_new(self, h: int | None) -> None:
        """A newly written block; ``h`` set once the block is full, None while partial."""
        self._take_one()
        if h is None:
            self.anon_in_use += 1
        elif h in self.ref or h in self.lru:  # identical content written by a concurrent request
            self.free += 1  # share the existing block instead
            self.acquire_cached(h)
        else:
            self.ref[h] = 1

    def seal(self, h: int) -> None:
        """A partial block became full: give it its hash (or share an identical one)."""
        self.anon_in_use -= 1
        if h in self.ref or h in self.lru:
            self.free += 1
            self.acquire_cached(h)
        else:
            self.ref[h] = 1

    def release(self, h: int | None) -> None:
        if h is None:
            self.anon_in_use -= 1
            self.free += 1
            return
        self.ref[h] -= 1
        if self.ref[h] == 0:
            del self.ref[h]
            self.lru[h] = None  # stays cached, now evictable; most recent at the end


# --------------------------------------------------------------------------- the simulator


@dataclass
class _Running:
    req: Request
    blocks: list[int | None]  # hash per block held (None = partial)
    generated: int = 0
    reserved: int = 0  # blocks still reserved for future decode growth


@dataclass
class SimResult:
    model: str
    gpu: str
    kv_format: str
    block_size: int
    num_blocks: int
    pool_bytes: int
    requests: list[dict] = field(default_factory=list)
    peak_concurrency: int = 0
    mean_concurrency: float = 0.0
    duration_s: float = 0.0
    max_bytes_held: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(r["prompt_tokens"] for r in self.requests)

    @property
    def cached_tokens(self) -> int:
        return sum(r["cached_tokens"] for r in self.requests)

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens served from the prefix cache."""
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def block_hit_rate(self) -> float:
        """Fraction of full prompt blocks served from the prefix cache."""
        return sum(r["cached_blocks"] for r in self.requests) / max(1, sum(r["prompt_blocks"] for r in self.requests))

    @property
    def output_tokens(self) -> int:
        return sum(r["output_tokens"] for r in self.requests)

    @property
    def throughput(self) -> float:
        """Generated tokens per second."""
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    def cost_per_million(self, gpu_hour_usd: float | None = None, tokens: str = "output") -> float:
        """Dollars per million tokens (``"output"`` or ``"total"`` = prompt + output).

        ``gpu_hour_usd`` defaults to the GPU's listed price (``data/presets/gpus.json``, with its source).
        """
        if tokens not in ("output", "total"):
            raise ValueError(f"tokens must be 'output' or 'total', got {tokens!r}")
        price = B.hourly_price(self.gpu, gpu_hour_usd)
        n = self.output_tokens if tokens == "output" else self.output_tokens + self.prompt_tokens
        return price * self.duration_s / 3600 / max(1, n) * 1e6

    def summary(self) -> dict:
        return {"model": self.model, "gpu": self.gpu, "kv_format": self.kv_format, "block_size": self.block_size,
                "num_blocks": self.num_blocks, "requests": len(self.requests), "hit_rate": self.hit_rate,
                "block_hit_rate": self.block_hit_rate, "prefill_tokens_saved": self.cached_tokens,
                "prefill_tokens_computed": self.prompt_tokens - self.cached_tokens,
                "peak_concurrency": self.peak_concurrency, "mean_concurrency": self.mean_concurrency,
                "throughput_tok_s": self.throughput, "duration_s": self.duration_s,
                "mean_queue_s": sum(r["queue_s"] for r in self.requests) / max(1, len(self.requests))}


def pool_blocks(model, gpu, kv_format, weights_dtype="bf16", block_size=16, memory_utilization=0.9,
                pool_bytes: int | None = None) -> tuple[int, int, int]:
    """``(num_blocks, block_bytes, pool_bytes)`` for a model on a GPU (or a fixed ``pool_bytes``)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 1 << 20:
        raise ValueError(f"block_size must be a whole number of tokens from 1 to 2**20, got {str(block_size)[:30]}")
    block_bytes = B.budget(model, 1, block_size, kv_format).bytes_per_token * block_size
    if pool_bytes is not None and (isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int) or pool_bytes <= 0):
        raise ValueError(f"pool_bytes must be a positive number of bytes, got {pool_bytes!r}")
    if pool_bytes is None:
        pool_bytes = B.fit(model, gpu, weights_dtype, memory_utilization=memory_utilization).free_for_cache_per_gpu
    if pool_bytes <= 0:
        raise ValueError(f"the weights of {model} leave no memory for the KV cache on {gpu}")
    if pool_bytes < block_bytes:
        raise ValueError(f"block_size={block_size}: one block of {block_bytes:,} bytes is larger than the "
                         f"{pool_bytes:,} bytes the KV pool has on {gpu}")
    return pool_bytes // block_bytes, block_bytes, pool_bytes


MAX_ARRIVAL_S = 365 * 24 * 3600  # a trace longer than a year is a unit mistake (milliseconds read as seconds?)


def _check_requests(requests, block_size: int) -> None:
    """Reject what would make the replay hang or report numbers that mean nothing."""
    if not isinstance(requests, list | tuple) or not requests:
        raise ValueError("no requests to simulate (an empty workload or trace has no cost to report)")
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(f"requests must be kvlab.simulator.Request objects, got {type(r).__name__}")
        if isinstance(r.arrival, bool) or not isinstance(r.arrival, int | float) or not math.isfinite(r.arrival):
            raise ValueError(f"request {r.rid}: arrival must be a finite number of seconds, got {r.arrival!r}")
        if r.prompt_len < 1 or r.output_len < 1:
            raise ValueError(f"request {r.rid}: prompt and output lengths must be >= 1")
        if r.block_size is not None and r.block_size != block_size:
            raise ValueError(f"request {r.rid} was hashed in blocks of {r.block_size} tokens: simulate it with "
                             f"block_size={r.block_size}, not {block_size}")
    span = max(r.arrival for r in requests) - min(r.arrival for r in requests)
    if span > MAX_ARRIVAL_S:
        raise ValueError(f"the requests arrive over {span:.3g} s, more than a year ({MAX_ARRIVAL_S:,} s): a unit "
                         "mistake (milliseconds read as seconds?), and a replay whose costs would mean nothing")


def simulate(requests: list[Request], model="llama-3.1-8b", gpu="H100-80GB", kv_format="bf16", *,
             weights_dtype="bf16", block_size=16, memory_utilization=0.9, pool_bytes: int | None = None,
             num_blocks: int | None = None, cost: CostModel | None = None) -> SimResult:
    """Replay ``requests`` (sorted by arrival) through one replica; see the module docstring."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    _check_requests(requests, block_size)
    shape = B.load_shape(model)
    window = shape.max_position_embeddings
    if window and (too_long := [r for r in requests if r.prompt_len + r.output_len > window]):
        r = too_long[0]
        raise ValueError(f"{len(too_long)} of {len(requests)} requests are longer than {shape.name}'s context of "
                         f"{window:,} tokens, which an engine would refuse; the first is request {r.rid} (a trace's "
                         f"line): {r.prompt_len:,} + {r.output_len:,} tokens. Replay them on a model with a longer context")
    nb, block_bytes, pbytes = pool_blocks(model, gpu, kv_format, weights_dtype, block_size,
                                          memory_utilization, pool_bytes)
    if num_blocks is not None:  # for experiments: an explicit pool size in blocks
        nb, pbytes = num_blocks, num_blocks * block_bytes
    g = B.get_gpu(gpu)
    cost = cost or CostModel(shape.num_parameters or 0, B.weights_bytes(model, weights_dtype),
                             g.peak_bf16_flops, g.bandwidth_bytes_per_s)
    pool = BlockPool(nb)
    res = SimResult(shape.name, g.name, str(kv_format), block_size, nb, pbytes)
    queue: deque[Request] = deque()
    running: list[_Running] = []
    reqs = sorted(requests, key=lambda r: r.arrival)
    i, now, conc_time, reserved = 0, reqs[0].arrival, 0.0, 0  # the clock starts at the first arrival
    bytes_per_token = block_bytes / block_size
    tokens_held = 0  # prompt + generated tokens of every running request (what one decode step reads)
    while i < len(reqs) or queue or running:
        if not running and not queue and i < len(reqs):
            now = max(now, reqs[i].arrival)
        while i < len(reqs) and reqs[i].arrival <= now:
            queue.append(reqs[i])
            i += 1
        # admit in FIFO order while the head's worst case fits
        prefill = 0
        while queue:
            r = queue[0]
            need_total = math.ceil((r.prompt_len + r.output_len) / block_size)
            if need_total > nb:
                raise ValueError(f"request {r.rid} needs {need_total} blocks but the pool has {nb}")
            hit = pool.lookup_prefix(r.prompt_hashes)
            # cached blocks that are only evictable would be taken out of the evictable set
            hit_evictable = sum(1 for h in r.prompt_hashes[:hit] if h in pool.lru)
            if need_total - hit + reserved > pool.available() - hit_evictable:
                break
            queue.popleft()
            for h in r.prompt_hashes[:hit]:
                pool.acquire_cached(h)
            blocks: list[int | None] = list(r.prompt_hashes[:hit])
            for h in r.prompt_hashes[hit:]:
                pool.acquire_new(h)
                blocks.append(h)
            if r.prompt_len % block_size:
                pool.acquire_new(None)
                blocks.append(None)
            grow = need_total - len(blocks)
            reserved += grow
            running.append(_Running(r, blocks, 0, grow))
            tokens_held += r.prompt_len
            prefill += r.prompt_len - hit * block_size
            res.requests.append({"rid": r.rid, "prompt_tokens": r.prompt_len, "cached_tokens": hit * block_size,
                                 "recomputed_tokens": r.prompt_len - hit * block_size,
                                 "prompt_blocks": len(r.prompt_hashes), "cached_blocks": hit,
                                 "output_tokens": r.output_len, "queue_s": now - r.arrival})
        if not running:
            if i < len(reqs):
                continue
            break
        # one engine step: the prefill above, plus one decode token per running request
        cache_read = tokens_held * bytes_per_token
        dt = cost.step_seconds(prefill, cache_read, decoding=True)
        res.peak_concurrency = max(res.peak_concurrency, len(running))
        conc_time += len(running) * dt
        now += dt
        still = []
        for x in running:
            x.generated += 1
            pos = x.req.prompt_len + x.generated  # tokens now held
            if (pos - 1) % block_size == 0 and pos > 1 and len(x.blocks) < math.ceil(pos / block_size):
                pool.acquire_new(None)  # decode opens a new block
                x.blocks.append(None)
                x.reserved -= 1
                reserved -= 1
            if pos % block_size == 0:  # a block just filled: hash it so it can be shared later
                k = pos // block_size - 1 - len(x.req.prompt_hashes)
                hashes = x.req.output_hashes or []
                h = hashes[k] if 0 <= k < len(hashes) else hash(("out", x.req.rid, pos))
                if x.blocks[-1] is None:
                    pool.seal(h)
                    x.blocks[-1] = h
            tokens_held += 1
            if x.generated >= x.req.output_len:
                for h in x.blocks:
                    pool.release(h)
                reserved -= x.reserved
                tokens_held -= pos
            else:
                still.append(x)
        running = still
        held = pool.used - len(pool.lru)  # blocks pinned by running requests
        res.max_bytes_held = max(res.max_bytes_held, held * block_bytes)
        assert held + reserved <= nb and pool.used <= nb, "the pool was overcommitted"
    res.duration_s = now - reqs[0].arrival
    res.mean_concurrency = conc_time / res.duration_s if res.duration_s else 0.0
    return res


# --------------------------------------------------------------------------- sweeps for the chapter


def working_set(requests: list[Request], model, kv_format, *, block_size=16) -> dict[str, int]:
    """The bytes a prefix cache would need for ``requests`` in ``kv_format``: ``"reused"``, the blocks that more
    than one request's prompt holds (what sharing can save), and ``"distinct"``, every different prompt block
    the trace writes (what an LRU pool, which cannot tell which block will come back, must hold before nothing
    useful is ever evicted). ``{"reused": bytes, "distinct": bytes, "block_bytes": bytes}``."""
    from collections import Counter

    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    _check_requests(requests, block_size)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 1 << 20:
        raise ValueError(f"block_size must be a whole number of tokens from 1 to 2**20, got {str(block_size)[:30]}")
    block_bytes = B.budget(model, 1, block_size, kv_format).bytes_per_token * block_size
    seen = Counter(h for r in requests for h in set(r.prompt_hashes))
    return {"reused": block_bytes * sum(n > 1 for n in seen.values()), "distinct": block_bytes * len(seen),
            "block_bytes": block_bytes}


def hit_rate_vs_pool(requests: list[Request], model, gpu, formats, pool_gib: list[float], *,
                     weights_dtype="bf16", block_size=16) -> dict[str, list[float]]:
    """Prefix hit rate for each format as the pool's *bytes* grow (same bytes -> more blocks in a smaller format)."""
    out = {}
    for fmt in formats:
        out[str(fmt)] = [simulate(requests, model, gpu, fmt, weights_dtype=weights_dtype, block_size=block_size,
                                  pool_bytes=int(g * 2**30)).hit_rate for g in pool_gib]
    return out


def cost_table(requests: list[Request], model, gpu, formats, *, gpu_hour_usd: float | None = None, weights_dtype="bf16",
               block_size=16, pool_bytes: int | None = None, quality: dict[str, float] | None = None,
               threshold: float = 0.9, reference: dict | float | None = None,
               perplexity: dict | None = None, max_ppl_increase: float = 0.05,
               needle: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """One row per format: hit rate, recomputed tokens, concurrency, throughput, $ per million output tokens.

    ``gpu_hour_usd`` defaults to the GPU's listed price (:func:`kvlab.budget.hourly_price`).

    ``quality`` maps a format to a score in [0, 1] measured elsewhere (chapter 4's long-context
    exact match), or to ``{context_length: score}`` (:func:`quality_by_length`); scores below
    ``threshold`` are flagged ``ok=False`` (per length in the second case). With ``reference``
    (full precision's score, or its ``{context_length: score}``) the bar is relative: a score
    passes when it reaches ``threshold`` times the reference's, so the model's own misses are
    not charged to the format.

    ``perplexity`` maps a format to its relative perplexity increase over full precision, or to
    ``{model: increase}`` for several models; increases above ``max_ppl_increase`` (on any model) are
    flagged ``ppl_ok=False``. Formats it does not name get ``None`` in both columns.

    ``needle`` maps a format to ``{model: verdict}``, chapter 4's paired needle verdicts
    (:func:`kvlab.facts.paired_risk`): "held", "reference" (full precision), or the test it failed;
    ``needle_ok`` is true when every model says "held" or "reference".
    """
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    if isinstance(max_ppl_increase, bool) or not isinstance(max_ppl_increase, (int, float)) \
            or not 0 <= max_ppl_increase < math.inf:
        raise ValueError(f"max_ppl_increase must be a finite fraction >= 0, got {max_ppl_increase!r}")
    def finite(v):
        return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)

    if perplexity is not None and not isinstance(perplexity, dict):
        raise TypeError(f"perplexity must be a dict, got {type(perplexity).__name__}")
    bad = {f: v for f, v in (perplexity or {}).items()
           if not (finite(v) or (isinstance(v, dict) and v and all(finite(x) for x in v.values())))}
    if bad:
        raise ValueError(f"perplexity increases must be finite numbers (or {{model: number}}), got {bad}")
    if needle is not None and not (isinstance(needle, dict) and all(
            isinstance(v, dict) and v and all(isinstance(x, str) for x in v.values()) for v in needle.values())):
        raise ValueError("needle must map each format to {model: verdict text}, e.g. {'int4': {'SmolLM2': 'held'}}")
    _check_scores("quality", quality)
    _check_scores("reference", reference if isinstance(reference, dict) or reference is None else {"": reference})

    def bar(n=None):
        if reference is None:
            return threshold
        ref = reference.get(n) if isinstance(reference, dict) else reference
        return threshold if ref is None else threshold * ref

    rows = []
    for fmt in formats:
        r = simulate(requests, model, gpu, fmt, weights_dtype=weights_dtype, block_size=block_size,
                     pool_bytes=pool_bytes)
        s = r.summary()
        q = None if quality is None else quality.get(str(fmt))
        if isinstance(q, dict):  # per context length: flag each length on its own
            ok = {n: None if v is None else v >= bar(n) - 1e-12 for n, v in q.items()}
        else:
            ok = None if q is None else q >= bar() - 1e-12
        ppl = None if perplexity is None else perplexity.get(str(fmt))
        ppl_all = list(ppl.values()) if isinstance(ppl, dict) else [ppl]
        nd = None if needle is None else needle.get(str(fmt))
        rows.append({"kv_format": str(fmt), "num_blocks": r.num_blocks, "hit_rate": s["hit_rate"],
                     "recomputed_tokens": s["prefill_tokens_computed"], "peak_concurrency": s["peak_concurrency"],
                     "throughput_tok_s": s["throughput_tok_s"], "usd_per_m_tokens": r.cost_per_million(gpu_hour_usd),
                     "quality": q, "ok": ok, "ppl_increase": ppl,
                     "ppl_ok": None if ppl is None else all(x <= max_ppl_increase + 1e-12 for x in ppl_all),
                     "ppl_limit": max_ppl_increase, "needle": nd, "needle_ok": None if nd is None else all(v in ("held", "reference") for v in nd.values())})
    return rows


def _check_scores(name: str, scores) -> None:
    """Quality scores are fractions in [0, 1] (or None where not measured), per format or per context length."""
    if scores is None:
        return
    if not isinstance(scores, dict):
        raise TypeError(f"{name} must be a dict, got {type(scores).__name__}")
    for key, v in scores.items():
        for x in (v.values() if isinstance(v, dict) else [v]):
            if x is None:
                continue
            if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1:  # NaN fails too
                raise ValueError(f"{name}[{key!r}] must hold scores in [0, 1], got {x!r}")


def cost_table_html(rows: list[dict]) -> str:
    """:func:`cost_table` rows as an HTML table, scores under the quality threshold flagged in red.

    With per-length quality (:func:`quality_by_length`) there is one column per context length;
    with perplexity increases there is a perplexity column, red above its limit.
    """
    red = " style='color:#b00;font-weight:bold'"
    if any(r.get("needle") for r in rows):
        return _needle_table_html(rows, red)
    with_ppl = any(r.get("ppl_increase") is not None for r in rows)

    def ppl(r):
        if not with_ppl:
            return ""
        v = r.get("ppl_increase")
        return "<td>—</td>" if v is None else f"<td{'' if r['ppl_ok'] else red}>{v:+.0%}</td>"

    ppl_head = "<th>perplexity</th>" if with_ppl else ""
    per_length = [r for r in rows if isinstance(r["quality"], dict)]
    if per_length:
        lengths = sorted({n for r in per_length for n in r["quality"]})

        def cell(r, n):
            v = r["quality"].get(n) if isinstance(r["quality"], dict) else None
            if v is None:
                return "<td>—</td>"
            return f"<td{'' if r['ok'][n] else red}>{v:.0%}</td>"

        head = "".join(f"<th>{n}</th>" for n in lengths)
        body = "".join(
            f"<tr><td>{r['kv_format']}</td><td>{r['hit_rate']:.1%}</td><td>${r['usd_per_m_tokens']:.2f}</td>"
            + ppl(r) + "".join(cell(r, n) for n in lengths) + "</tr>" for r in rows)
        note = " Perplexity: increase over full precision; red: above its limit." if with_ppl else ""
        return ("<table><tr><th>format</th><th>hit rate</th><th>$/M tokens</th>" + ppl_head + head + "</tr>" + body
                + "</table><p>Passkey exact match per context length (tokens); red: under the threshold." + note
                + "</p>")

    def flag(r):
        return "—" if r["ok"] is None else ("ok" if r["ok"] else "<b style='color:#b00'>below threshold</b>")

    cells = "".join(
        f"<tr><td>{r['kv_format']}</td><td>{r['hit_rate']:.1%}</td><td>${r['usd_per_m_tokens']:.2f}</td>"
        f"{ppl(r)}<td>{'' if r['quality'] is None else format(r['quality'], '.0%')}</td><td>{flag(r)}</td></tr>"
        for r in rows)
    return ("<table><tr><th>format</th><th>hit rate</th><th>$/M tokens</th>" + ppl_head
            + "<th>quality</th><th></th></tr>" + cells + "</table>")


def _needle_table_html(rows: list[dict], red: str) -> str:
    """:func:`cost_table_html` with chapter 4's paired needle verdicts: a needle and a perplexity column per model."""
    models = next(list(r["needle"]) for r in rows if r.get("needle"))

    def ppl(r, m):
        v = r.get("ppl_increase")
        v = v.get(m) if isinstance(v, dict) else v
        if v is None:
            return "<td>—</td>"
        return f"<td{red if v > r['ppl_limit'] + 1e-12 else ''}>{v:+.1%}</td>"

    def nd(r, m):
        v = (r.get("needle") or {}).get(m)
        if v is None:
            return "<td>not measured</td>"
        return f"<td{'' if v in ('held', 'reference') else red}>{v}</td>"

    head = "".join(f"<th>needle, {m}</th><th>perplexity, {m}</th>" for m in models)
    body = "".join(f"<tr><td>{r['kv_format']}</td><td>{r['hit_rate']:.1%}</td><td>${r['usd_per_m_tokens']:.2f}</td>"
                   + "".join(nd(r, m) + ppl(r, m) for m in models) + "</tr>" for r in rows)
    return ("<table><tr><th>format</th><th>hit rate</th><th>$/M tokens</th>" + head + "</tr>" + body + "</table>"
            "<p>Needle: chapter 4's paired verdict against full precision on identical prompts (held, or the test it "
            "failed); perplexity: increase over full precision. Red: not held, or above the perplexity limit.</p>")
