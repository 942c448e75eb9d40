"""Choosing a KV format for a server: what each format buys, what it risks, and how to switch to it.

:func:`options` puts the workbook's measurements into one row per format for a given model, GPU,
context and concurrency:

* **what it buys** (chapter 1 and 3): cache bytes, whether the load fits, the most sequences that fit
  at this context, and a whole-model decode step from a roofline with the weights and the KV cache
  read together: ``time = max(bytes read / bandwidth, FLOPs / peak)`` for one step of the whole batch.
  A format cannot speed up the part of the step that reads weights, so its gain shrinks when the
  weights dominate (small batch, short context) and grows when the cache does.
* **what it risks** (chapter 4): the paired needle verdict (never worse than full precision on identical
  prompts, at any length or pooled) and the perplexity cost on each of chapter 4's two models
  (:func:`kvlab.facts.paired_risk`), with the caveat that these are two small models.
* **how to switch** (``kvlab formats --engines``): each engine's flag for the format, from its docs.
* **what to run first**: the ``kvlab niah --endpoint`` command for the context you serve.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import budget as B
from .formats import engine_options, get_format
from .roofline import MBU, MFU, step_seconds

DEFAULT_FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "kivi-4", "q4_0", "int4_tensor")


@dataclass(frozen=True)
class StepTime:
    """One decode step of the whole model for ``batch`` sequences of ``context`` tokens on one GPU."""

    weights_bytes: float
    cache_bytes: float
    flops: float
    seconds: float
    bound: str  # "memory" or "compute"

    @property
    def cache_share(self) -> float:
        """The fraction of the bytes read that is KV cache."""
        return self.cache_bytes / (self.cache_bytes + self.weights_bytes)


def step_time(model, batch: int, context: int, kv_format="bf16", gpu="H100-80GB", weights_dtype="bf16", *,
              tp: int = 1, mbu: float = MBU, mfu: float = MFU) -> StepTime:
    """Roofline of one decode step: every weight and every sequence's cache read once, per GPU.

    FLOPs: 2 per parameter per sequence for the matmuls, plus attention's 4 per cached element
    per query head (q.k and p.v). ``mbu`` and ``mfu`` scale peak bandwidth and FLOPs (1.0: the
    roofline itself; by default the workbook's one assumption, :data:`kvlab.roofline.MBU` and ``MFU``,
    which moves every format alike).
    """
    for name, v in (("mbu", mbu), ("mfu", mfu)):
        if not isinstance(v, int | float) or not 0 < v <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {v!r}")
    g = B.get_gpu(gpu)
    shape = B.load_shape(model)
    w = B.weights_bytes(model, weights_dtype) / tp
    cache = B.budget(model, batch, context, kv_format, tp=tp).cache_bytes_per_gpu
    layer = next((x for x in shape.layers if x.kv_heads), shape.layers[0])
    attn = 4 * batch * context * (layer.head_dim or layer.latent_dim) * max(shape.q_heads, 1) * shape.num_layers
    flops = (2 * shape.num_parameters * batch + attn) / tp
    t, bound = step_seconds(w + cache, flops, g.bandwidth_bytes_per_s, g.peak_bf16_flops, mbu=mbu, mfu=mfu)
    return StepTime(w, cache, flops, t, bound)


def latency(model, context: int, kv_format="bf16", gpu="H100-80GB", weights_dtype="bf16", *, batch: int = 1,
            tp: int = 1, mbu: float = MBU, mfu: float = MFU, weights_gib: float | None = None) -> dict:
    """Predicted time to first token and time per output token, from the roofline (model predictions until a GPU
    measures them): ``{"ttft_s", "ttft_bound", "tpot_s", "tpot_bound"}``.

    TTFT is the prefill of one ``context``-token prompt alone on the GPU: 2 FLOPs per parameter per token plus
    causal attention's 2 x context^2 x head_dim per query head and layer, at ``mfu`` x peak FLOP/s, or the weights
    and the cache it writes read at ``mbu`` x peak bandwidth if that is slower (it rarely is). TPOT is one decode step
    with ``batch`` sequences of ``context`` tokens (:func:`step_time`): bandwidth-bound, so it is where a smaller
    cache shows. Queueing, scheduling and tensor-parallel communication are not counted. ``weights_gib``: the
    weights' size on each GPU as your engine logged it, read instead of the size counted from ``weights_dtype``.
    """
    context, batch = B._positive_int("context", context), B._positive_int("batch", batch)
    g, shape = B.get_gpu(gpu), B.load_shape(model)
    layer = next((x for x in shape.layers if x.kv_heads), shape.layers[0])
    attn = 2 * context * context * (layer.head_dim or layer.latent_dim) * max(shape.q_heads, 1) * shape.num_layers
    flops = (2 * shape.num_parameters * context + attn) / tp
    w = B.weights_bytes(model, weights_dtype) / tp if weights_gib is None else B._gib("weights_gib", weights_gib) * B.GIB
    nbytes = w + B.budget(model, 1, context, kv_format, tp=tp).cache_bytes_per_gpu
    ttft, ttft_bound = step_seconds(nbytes, flops, g.bandwidth_bytes_per_s, g.peak_bf16_flops, mbu=mbu, mfu=mfu)
    step = step_time(model, batch, context, kv_format, gpu, weights_dtype, tp=tp, mbu=mbu, mfu=mfu)
    # the decode step reads the weights the engine holds (the logged size where one is given) and the cache
    tpot, tpot_bound = step_seconds(w + step.cache_bytes, step.flops, g.bandwidth_bytes_per_s, g.peak_bf16_flops,
                                    mbu=mbu, mfu=mfu)
    return {"ttft_s": ttft, "ttft_bound": ttft_bound, "tpot_s": tpot, "tpot_bound": tpot_bound}


TP_SIZES = (1, 2, 4, 8)  # tensor-parallel sizes within one 8-GPU node


def plan(model, gpu, context: int, concurrency: int, kv_format="bf16", *, weights_dtype: str = "bf16",
         max_gpus: int = 64, memory_utilization: float = 0.9, gpu_hour_usd: float | None = None,
         reserve_gib=B.TP_RESERVE_GIB) -> dict | None:
    """The fewest GPUs that hold ``concurrency`` sequences of ``context`` tokens in ``kv_format``.

    Tries every tensor-parallel size in :data:`TP_SIZES` that the model's heads split into, with as many
    replicas as it takes; the fewest GPUs wins, then the higher throughput. Throughput is the decode
    roofline at :data:`kvlab.roofline.MBU` (tensor-parallel communication not counted), each replica
    running its share of the load (the sequences split as evenly as they go); cost is dollars per million
    generated tokens at the GPU's listed (or
    the given) hourly price, every GPU busy decoding. ``reserve_gib`` is the engine's own memory per GPU
    (see :func:`kvlab.budget.fit`): a number for every size, or ``{tp: GiB}`` for a reserve that grows with tensor
    parallelism (:func:`reserve_at`); the default is what vLLM logged at 1 and 2 GPUs (:data:`kvlab.budget.TP_RESERVE_GIB`).
    ``None`` when no configuration of at most ``max_gpus`` GPUs holds the load. ``spare``: sequences of room
    left over (0: the load fills the pool exactly, no headroom).
    """
    context = B._positive_int("context", context)
    concurrency = B._positive_int("concurrency", concurrency)
    max_gpus = B._positive_int("max_gpus", max_gpus)
    name = get_format(kv_format).name
    shape = B.load_shape(model)
    if shape.max_position_embeddings and context > shape.max_position_embeddings:
        raise ValueError(f"context {context:,} is past {shape.name}'s {shape.max_position_embeddings:,}-token window")
    reserves = _reserves(reserve_gib)  # checked before the search
    best = None
    for tp in TP_SIZES:
        try:
            B._check_tp(shape, tp)
        except ValueError:  # heads that do not split over tp ranks: not a layout an engine can run
            continue
        reserve = _reserve_for(reserves, tp)
        room = B.max_concurrency(model, context, name, gpu, weights_dtype, tp=tp,
                                 memory_utilization=memory_utilization, reserve_gib=reserve)
        if not room:
            continue
        replicas = -(-concurrency // room)
        if tp * replicas > max_gpus:
            continue
        shares = [concurrency // replicas + (i < concurrency % replicas) for i in range(replicas)]
        batch = shares[0]  # the fullest replica's share; the others take the same or one fewer
        step = {b: step_time(model, b, context, name, gpu, weights_dtype, tp=tp).seconds for b in set(shares)}
        tps = sum(b / step[b] for b in shares)
        key = (tp * replicas, -tps)
        if best is None or key < best[0]:
            best = (key, {"kv_format": name, "tp": tp, "replicas": replicas, "gpus": tp * replicas,
                          "per_replica": room, "batch_per_replica": batch, "step_ms": step[batch] * 1e3,
                          "spare": replicas * room - concurrency,
                          "tokens_per_s": tps})
    if best is None:
        return None
    row = best[1]
    usd = B.hourly_price(gpu, gpu_hour_usd) * row["gpus"]
    row["usd_per_million_tokens"] = usd / (row["tokens_per_s"] * 3600) * 1e6
    return row


def vllm_command(plan: dict, context: int, model: str = "YOUR/MODEL", memory_utilization: float = 0.9) -> str:
    """The ``vllm serve`` line that runs one replica of :func:`plan`'s configuration: its KV dtype flag (from
    ``kvlab formats --engines``), the context, the memory share the plan assumed, the tensor-parallel size and at
    most as many sequences as its pool holds. Empty when vLLM does not offer the plan's format."""
    flag = engine_options(plan["kv_format"]).get("vLLM")
    if not flag:
        return ""
    kv = flag.split(" (")[0].split(" with ")[0]  # "--kv-cache-dtype fp8 (= fp8_e4m3)" -> "--kv-cache-dtype fp8"
    line = (f"vllm serve {model} {kv} --max-model-len {context} --gpu-memory-utilization {memory_utilization:g} "
            f"--tensor-parallel-size {plan['tp']} --max-num-seqs {plan['per_replica']}")
    notes = []
    if plan["replicas"] > 1:
        notes.append(f"on each of {plan['replicas']} replicas ({plan['tp']} GPU{'s' if plan['tp'] > 1 else ''} each), "
                     "behind a load balancer")
    if "fp8" in kv:  # vLLM reads FP8 scales from the checkpoint, else 1.0 (--calculate-kv-scales was removed, PR #49389)
        notes.append("FP8 scales from a checkpoint calibrated with llm-compressor, else 1.0 (chapter 2); "
                     "compare it with a BF16 server first (chapter 6.5)")
    return line + ("   # " + "; ".join(notes) if notes else "")


def reserve_at(tp: int, reserve_gib=B.TP_RESERVE_GIB) -> float:
    """The engine's reserve in GiB on each GPU at tensor-parallel size ``tp``: a number applies at every size; a
    dict ``{tp: GiB}`` must give tp=1, and a size it leaves out takes the entry of the largest size below it (a
    reserve grows with tensor parallelism, it does not shrink)."""
    return _reserve_for(_reserves(reserve_gib), B._positive_int("tp", tp))


def _reserve_for(reserves: dict[int, float], tp: int) -> float:
    return reserves[B.logged_size(reserves, tp)]


def _reserves(reserve_gib) -> dict[int, float]:
    if not isinstance(reserve_gib, dict):
        return {1: B._gib("reserve_gib", reserve_gib)}
    if not reserve_gib or 1 not in reserve_gib:
        raise ValueError(f"reserve_gib as a dict must give tp=1 (GiB per GPU by tensor-parallel size), got {reserve_gib!r}")
    for tp in reserve_gib:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"reserve_gib's keys must be tensor-parallel sizes (positive integers), got {tp!r}")
    return {tp: B._gib(f"reserve_gib[{tp}]", v) for tp, v in reserve_gib.items()}


EVAL_DEPTHS, EVAL_TRIALS = (0.0, 0.25, 0.5, 0.75, 1.0), 10  # the comparison each row prints: 50 prompts a length
EVAL_HAYSTACK = "YOUR_TRAFFIC.txt"  # the printed comparison cuts its haystacks from the user's own text
EVAL_MAX_TOKENS = 12  # tokens each answer may take (kvlab niah's default): the longest prompt is the context minus these
EVAL_PPL_WINDOWS = 16  # held-out passages for perplexity, as chapter 4 read
REFERENCE_FORMATS = ("bf16", "fp16", "fp32")  # full precision: the reference every paired test compares against


def _quality(risk: dict | None, fmt: str) -> dict:
    """Chapter 4's paired verdicts for ``fmt`` on each model of ``risk`` (:func:`kvlab.facts.paired_risk`)."""
    if risk is None:
        return {"measured": False}
    if fmt in REFERENCE_FORMATS:
        return {"measured": True, "reference": True, "models": {}}
    # a model where only some of the evidence is in (a format added to a sweep later: perplexity first) is kept,
    # with ``needle`` None; the format counts as measured only with a needle verdict on every model
    models = {m: {"held": fmt in r["held"], "needle": r["needle"].get(fmt), "ppl_increase": r["ppl"].get(fmt)}
              for m, r in risk.items() if fmt in r["needle"] or fmt in r["ppl"]}
    measured = bool(risk) and all(fmt in r["needle"] for r in risk.values())
    return {"measured": measured, "reference": False, "models": models}


def options(model, gpu, context: int, concurrency: int, *, weights_dtype: str = "bf16", formats=DEFAULT_FORMATS,
            tp: int = 1, memory_utilization: float = 0.9, risk: dict | None = None, endpoint_hint: str = "URL") -> list[dict]:
    """One row per format for serving ``concurrency`` sequences of ``context`` tokens (see the module docstring).

    ``risk`` is chapter 4's paired verdicts per model (:func:`kvlab.facts.paired_risk`); without it the
    quality columns say "not measured". Rows keep the order of ``formats``; the first is the baseline
    the speed-ups are measured against.
    """
    context = B._positive_int("context", context)
    concurrency = B._positive_int("concurrency", concurrency)
    formats = [get_format(f).name for f in formats]
    if not formats:
        raise ValueError("give at least one KV format")
    f = B.fit(model, gpu, weights_dtype, tp=tp, memory_utilization=memory_utilization)
    if not f.weights_fit:
        raise ValueError(f"{B.load_shape(model).name} in {weights_dtype} does not fit on {tp} x {gpu}: "
                         f"{f.weights_bytes_per_gpu / B.GIB:.0f} GiB of weights and {f.reserve_bytes_per_gpu / B.GIB:.2f} GiB "
                         f"of engine reserve per GPU, {f.usable_bytes_per_gpu / B.GIB:.0f} GiB usable")
    base = None
    rows = []
    # chapter 4's advice: perplexity first, then needles at several lengths up to the context served, not only the longest
    # (the longest leaves room for the answer: a server started with --max-model-len=context refuses more)
    longest = context - EVAL_MAX_TOKENS
    lengths = ",".join(str(n) for n in sorted({n for n in (context // 8, context // 2) if 256 <= n < longest} | {longest}))
    eval_args = (f"--lengths {lengths} --depths {','.join(f'{d:g}' for d in EVAL_DEPTHS)} --trials {EVAL_TRIALS} "
                 f"--max-tokens {EVAL_MAX_TOKENS} --haystack-file {EVAL_HAYSTACK} --ppl-windows {EVAL_PPL_WINDOWS}")
    for name in formats:
        b = B.budget(model, concurrency, context, name, tp=tp)
        fits = b.cache_bytes_per_gpu <= f.free_for_cache_per_gpu
        most = B.max_concurrency(model, context, name, gpu, weights_dtype, tp=tp, memory_utilization=memory_utilization)
        batch = min(concurrency, most) if most else 0
        st = step_time(model, batch, context, name, gpu, weights_dtype, tp=tp) if batch else None
        tps = batch / st.seconds if st else 0.0
        if base is None:
            base = tps
        try:
            engines = {k: v for k, v in engine_options(name).items() if v}
        except ValueError:  # not a preset: no engine table row
            engines = {}
        rows.append({
            "kv_format": name, "bits_per_element": get_format(name).bits_per_element(
                max(x.head_dim or x.latent_dim for x in B.load_shape(model).layers)),
            "cache_gib_per_gpu": b.cache_bytes_per_gpu / B.GIB, "fits": fits, "max_concurrency": most,
            "running": batch, "step_ms": st.seconds * 1e3 if st else None, "bound": st.bound if st else None,
            "cache_share": st.cache_share if st else None, "tokens_per_s": tps,
            "speedup": tps / base if base else None, "engines": engines,
            "quality": _quality(risk, name),
            "eval_args": eval_args, "eval": f"kvlab niah --endpoint {endpoint_hint} {eval_args}",
        })
    return rows


def switch_md(row: dict, baseline: str = "bf16") -> str:
    """How to switch to ``row``'s format (a row of :func:`options`): each engine's flag as code (a note after it
    in parentheses stays text), then the ``kvlab niah`` command comparing the two servers."""
    def flag(text: str) -> str:
        cmd, _, note = text.partition(" (")
        return f"`{cmd}`" + (f" ({note}" if note else "")

    name = row["kv_format"]
    host = name.replace("_", "-")  # an underscore is not valid in a host name
    lines = [f"* **{engine}**: {flag(text)}" for engine, text in row["engines"].items()]
    return "\n".join(lines) + (
        f"\n\n```bash\nkvlab niah --endpoint http://{baseline}-server:8000 --compare http://{host}-server:8000 \\\n"
        f"    --tokenizer YOUR/MODEL {row['eval_args']} --out {name}-vs-{baseline}.json\n```")


_NOT_RUN = {"held": False, "needle": None, "ppl_increase": None}  # a model without a verdict on the format yet


def risk_models(rows) -> list[str]:
    """The models of the rows' risk columns, in the order they first appear (a format added to the sweeps later
    may have only some of them)."""
    return list(dict.fromkeys(m for r in rows for m in r["quality"].get("models", {})))


def per_model(quality: dict, models: list[str]) -> list[dict]:
    """A row's quality on each of ``models``; a model without any verdict on it yet reads as not run."""
    return [quality["models"].get(m, _NOT_RUN) for m in models]


def short_needle(label: str | None) -> str:
    """A needle verdict as a table cell: "worse pooled (−6 +0)" -> "worse pooled"; None -> "not run yet"."""
    return "not run yet" if label is None else label.split(" (")[0]


def pct(x: float) -> str:
    """A perplexity change as a table shows it: "+0.4%", and "±0.0%" for a change that rounds to zero."""
    t = f"{x:+.1%}"
    return "±0.0%" if t in ("+0.0%", "-0.0%") else t


def short_model_name(name: str) -> str:
    """A model's name as a table column says it: "SmolLM2-135M-Instruct" -> "SmolLM2", "Gemma 3 270M" -> "Gemma"."""
    return name.split()[0].split("-")[0]


def markdown(rows: list[dict], quality: bool = True) -> str:
    """The decision table as Markdown (numbers rounded for reading); ``quality=False`` leaves out the risk columns
    (chapter 4's paired needle verdict and perplexity change, one value per model, in the models' order)."""
    models = risk_models(rows)
    quality = quality and bool(models)
    head = ("| format | bits an element | cache of the whole load | whole load fits one GPU | sequences one GPU holds | "
            "decode step, one GPU full | tokens/s, one GPU | vs first row |")
    rule = "|---|---:|---:|---|---:|---:|---:|---:|"
    if quality:
        who = " · ".join(short_model_name(m) for m in models)
        head += f" needle held ({who}) | perplexity ({who}) |"
        rule += "---|---|"
    out = [head, rule]
    for r in rows:
        step = f"{r['step_ms']:.1f} ms" if r["step_ms"] is not None else "—"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "—"
        line = (f"| `{r['kv_format']}` | {r['bits_per_element']:g} | {r['cache_gib_per_gpu']:.1f} GiB | "
                f"{'yes' if r['fits'] else '**no**'} | {r['max_concurrency']:,} | {step} | {r['tokens_per_s']:,.0f} | {sp} |")
        if quality:
            q = r["quality"]
            if q.get("reference"):
                line += " reference | reference |"
            elif not q.get("models"):
                line += " not measured | — |"
            else:
                ms = per_model(q, models)
                line += (" " + " · ".join("not run yet" if x["needle"] is None else "yes" if x["held"] else "**no**"
                                          for x in ms) + " | "
                         + " · ".join(pct(x["ppl_increase"]) if x["ppl_increase"] is not None else "—" for x in ms) + " |")
        out.append(line)
    return "\n".join(out)


def throughput_curves(model, gpu, context: int, formats=DEFAULT_FORMATS, concurrencies=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                      *, weights_dtype: str = "bf16", tp: int = 1, memory_utilization: float = 0.9) -> dict[str, tuple]:
    """Roofline tokens/s per format: ``{format: (xs, ys)}`` at each concurrency that fits, plus the point
    where the pool is full (the most sequences that fit), so each curve ends where its format runs out."""
    out = {}
    for name in [get_format(f).name for f in formats]:
        most = B.max_concurrency(model, context, name, gpu, weights_dtype, tp=tp, memory_utilization=memory_utilization)
        xs = sorted({n for n in concurrencies if n <= most} | ({most} if most else set()))
        out[name] = (xs, [n / step_time(model, n, context, name, gpu, weights_dtype, tp=tp).seconds for n in xs])
    return out


def shortlist(rows: list[dict], max_ppl: float | None = None) -> list[str]:
    """Formats an engine offers that held on the needle on every model of chapter 4's paired sweeps (never
    worse than full precision at one length in either haystack, nor pooled) and whose perplexity cost is
    under ``max_ppl`` on every model, in the rows' order; full precision (the reference) is kept.
    ``max_ppl`` defaults to the workbook's one perplexity bar, :data:`kvlab.results.PPL_TOLERANCE`."""
    if max_ppl is None:
        from .results import PPL_TOLERANCE as max_ppl
    return [r["kv_format"] for r in rows if r["engines"] and passes_screen(r["quality"], max_ppl)]


def passes_screen(quality: dict, max_ppl: float) -> bool:
    """Whether a format's quality (:func:`options`' ``quality``) passes chapter 6's screen: measured, and held on the
    needle with perplexity under ``max_ppl`` on every model (full precision, the reference, passes)."""
    if not quality["measured"]:
        return False
    return quality["reference"] or all(m["held"] and m["ppl_increase"] is not None and m["ppl_increase"] < max_ppl
                                       for m in quality["models"].values())


# Modelled throughputs this close are a tie: the roofline assumes every kernel reads its format at the same
# efficiency, so a difference of a few bytes of scales a token (int8's 1%) is below what it can resolve.
THROUGHPUT_TIE = 0.02


def choose(plans: dict[str, dict | None], rows: list[dict], tie: float = THROUGHPUT_TIE,
           max_ppl: float | None = None) -> dict:
    """The format to deploy: of :func:`shortlist` (the reference aside) with a plan, the fewest GPUs; of those,
    every format within ``tie`` (a fraction) of the best modelled throughput ties, and the tie goes to the format
    the most engines offer (the one you can deploy anywhere), then to throughput.

    ``plans``: format -> :func:`plan` (None: no plan holds the load); ``rows``: :func:`options`' rows;
    ``max_ppl``: the perplexity bar (:func:`shortlist`'s default when None). Returns ``{"call": format or None, "tied": [formats tied with it, best first]}``."""
    if not 0 <= tie < 1 or isinstance(tie, bool):
        raise ValueError(f"tie must be a fraction in [0, 1), got {tie!r}")
    engines = {r["kv_format"]: r["engines"] for r in rows}
    safe = [f for f in shortlist(rows, max_ppl) if f not in REFERENCE_FORMATS and plans.get(f)]
    if not safe:
        return {"call": None, "tied": []}
    fewest = min(plans[f]["gpus"] for f in safe)
    best = max(plans[f]["tokens_per_s"] for f in safe if plans[f]["gpus"] == fewest)
    tied = sorted((f for f in safe if plans[f]["gpus"] == fewest and plans[f]["tokens_per_s"] >= (1 - tie) * best),
                  key=lambda f: (-len(engines[f]), -plans[f]["tokens_per_s"]))
    return {"call": tied[0], "tied": tied[1:]}


def by_engine(plans: dict[str, dict | None], rows: list[dict]) -> dict[str, list[str]]:
    """For each engine that offers a format of :func:`shortlist`, those formats, best first (fewest GPUs, then
    modelled throughput): the answer for a reader whose engine is already chosen. Engines in the order the rows
    name them; the reference (full precision) left out."""
    out = {}
    for e in dict.fromkeys(e for r in rows for e in r["engines"]):
        mine = [r for r in rows if e in r["engines"] or r["kv_format"] in REFERENCE_FORMATS]
        c = choose(plans, mine)  # the same rule as the call, on this engine's formats (ties: more engines first)
        if c["call"]:
            rest = [f for f in shortlist(mine) if f not in REFERENCE_FORMATS and plans.get(f)
                    and f != c["call"] and f not in c["tied"]]
            out[e] = [c["call"], *c["tied"], *sorted(rest, key=lambda f: (plans[f]["gpus"], -plans[f]["tokens_per_s"]))]
    return out


def by_engine_md(picks: dict[str, list[str]], plans: dict[str, dict | None], rows: list[dict]) -> str:
    """:func:`by_engine` as a table: each engine's first format, its flag (the notes after it are in
    :func:`switch_md`), its GPUs, and the engine's other formats that passed, each with its GPUs and whether it
    ties the first (as :func:`choose` ties: as many GPUs, modelled throughput within ``THROUGHPUT_TIE``) or by how
    much less throughput it models."""
    flags = {r["kv_format"]: r["engines"] for r in rows}

    def other(f, first):
        a, b = plans[f], plans[first]
        if a["gpus"] != b["gpus"]:
            return f"`{f}` ({a['gpus']} GPUs)"
        if a["tokens_per_s"] >= (1 - THROUGHPUT_TIE) * b["tokens_per_s"]:
            return f"`{f}` ({a['gpus']} GPUs, a tie)"
        return f"`{f}` ({a['gpus']} GPUs, {1 - a['tokens_per_s'] / b['tokens_per_s']:.1%} less throughput)"

    out = ["| engine | format | flag | GPUs | also passed |", "|---|---|---|---:|---|"]
    for engine, fs in picks.items():
        first = fs[0]
        flag = flags[first][engine].partition(" (")[0]
        also = ", ".join(other(f, first) for f in fs[1:]) or "—"
        out.append(f"| {engine} | `{first}` | `{flag}` | {plans[first]['gpus']} | {also} |")
    return "\n".join(out)
