"""Benchmark: greedy decode through ``KVQuantCache`` vs ``transformers``' ``DynamicCache``, on a CPU.

For each context length, one full-precision prefill fills a ``DynamicCache``; every preset
format's cache is filled from it (``KVQuantCache.from_prefill``). Then, in rounds, each cache
decodes a few greedy tokens, one cache after another, so every ratio compares times measured
side by side under the same load. Reported per (context, format): median ms per token, its
ratio to ``DynamicCache`` (median of the per-round ratios), the bytes the cache holds, and the
decode-time memory of one layer's attention above the cache (``kvlab.fusion.peak_memory`` of
``KVQuantLayer.attend``) beside one tile's size and the full-precision K and V of that layer
(what an unfused path would expand). Written to ``data/results/decode_cpu.json`` after each
context, with the machine.

    python benchmarks/decode_cpu.py [--contexts 1024 4096 8192] [--threads 1] [--quick]

The issue's target (SmolLM2-135M at 8192 tokens): INT8 and FP8 within 1.3x of ``DynamicCache``'s
time per token, INT4 within 1.5x.
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
from pathlib import Path

from kvlab.cli import MAX_LENGTH, Parser, int_flag, model_flag, model_problem, path_flag
from kvlab.env import cpu_model
from kvlab.formats import format_names, get_format
from kvlab.paths import RESULTS_DIR, out_problem, write_json

ROOT = Path(__file__).resolve().parents[1]

OUT = RESULTS_DIR / "decode_cpu.json"


def _copy(dyn, config):
    from transformers import DynamicCache

    out = DynamicCache(config=config)
    for i, layer in enumerate(dyn.layers):
        out.update(layer.keys.clone(), layer.values.clone(), i)
    return out


def _decode(model, cache, first, n: int) -> float:
    """Median seconds per greedy token over ``n`` steps."""
    import torch

    x, times = first, []
    with torch.no_grad():
        for _ in range(n):
            t = time.perf_counter()
            out = model(x, past_key_values=cache)
            times.append(time.perf_counter() - t)
            x = out.logits[:, -1:].argmax(-1)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=model_flag, default="smollm2-135m")
    p.add_argument("--contexts", type=int_flag(64, MAX_LENGTH), nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--formats", nargs="+", default=None, help="default: every preset")
    p.add_argument("--tokens", type=int_flag(1, 4096), default=6, help="greedy tokens per cache per round")
    p.add_argument("--rounds", type=int_flag(1, 1000), default=3)
    p.add_argument("--threads", type=int_flag(1, 1024), default=1)
    p.add_argument("--quick", action="store_true", help="kvlab-tiny, 256 tokens, two formats (a smoke test)")
    p.add_argument("--out", type=path_flag, default=OUT)
    args = p.parse_args(argv)
    if args.out is not None and (why := out_problem(args.out)):  # before the run, not after it
        p.error(why)
    quick_sets = ("model", "contexts", "formats", "tokens", "rounds")
    if args.quick and (given := [k for k in quick_sets if getattr(args, k) != p.get_default(k)]):
        p.error(f"--quick sets --{given[0]} itself (a fixed smoke test): drop one of the two")
    if args.quick:
        args.model, args.contexts, args.formats, args.tokens, args.rounds = "kvlab-tiny", [256], ["int8", "int4"], 2, 1
    try:
        formats = [get_format(f).name for f in args.formats or format_names()]
    except ValueError as e:
        p.error(f"--formats: {e}")
    for flag, vals in (("formats", formats), ("contexts", args.contexts)):
        if len(set(vals)) < len(vals):
            p.error(f"--{flag} lists {next(v for v in vals if vals.count(v) > 1)} twice")
    if why := model_problem(args.model):  # before torch loads
        p.error(why)
    import torch
    from transformers import DynamicCache

    from kvlab.cache import KVQuantCache
    from kvlab.fusion import peak_memory
    from kvlab.kernels.reference import attend_tiles
    from kvlab.models import load_model

    tile = attend_tiles.__kwdefaults__["block"]
    torch.set_num_threads(args.threads)
    try:
        model, tok = load_model(args.model)
    except (ValueError, OSError) as e:
        p.error(f"--model: {e}")
    window = getattr(model.config, "max_position_embeddings", None)
    if window and max(args.contexts) > window:
        p.error(f"--contexts: {max(args.contexts)} tokens is past {args.model}'s {window}-token window")
    for f in formats:  # a per-layer-type mix the model has no layers for, said before any prefill
        try:
            KVQuantCache(f, config=model.config)
        except ValueError as e:
            p.error(f"--formats: {e}")
    result = {
        "what": "ms per greedy decode token, KVQuantCache (kvlab attention: tile by tile over the stores) "
                "vs DynamicCache (SDPA), same model, same prompt, measured in interleaved rounds",
        "model": args.model, "threads": args.threads, "tokens_per_round": args.tokens, "rounds": args.rounds,
        "tile_tokens": tile, "machine": cpu_model(), "torch": torch.__version__,
        "date": dt.date.today().isoformat(), "contexts": {},
    }
    g = torch.Generator().manual_seed(0)
    for T in args.contexts:
        ids = torch.randint(100, min(tok.vocab_size, 30000), (1, T), generator=g)
        with torch.no_grad():
            dyn = DynamicCache(config=model.config)
            out = model(ids, past_key_values=dyn, logits_to_keep=1)
        first = out.logits[:, -1:].argmax(-1)
        caches = {"DynamicCache": _copy(dyn, model.config)}
        caches.update({f: KVQuantCache.from_prefill(f, dyn) for f in formats})
        times = {name: [] for name in caches}
        for _ in range(args.rounds):
            for name, cache in caches.items():
                times[name].append(_decode(model, cache, first, args.tokens))
        rows = {}
        for name, cache in caches.items():
            ratios = [t / d for t, d in zip(times[name], times["DynamicCache"])]
            row = {"ms_per_token": round(1000 * statistics.median(times[name]), 2),
                   "ratio_to_dynamic": round(statistics.median(ratios), 3)}
            if name != "DynamicCache":
                layer = cache.layers[0]
                q = torch.randn(1, model.config.num_attention_heads, layer.k_store.head_dim or 64)
                _, peak = peak_memory(layer.attend, q)
                kv_heads, D = layer.sink_k.shape[1], q.shape[-1]
                row.update(cache_bytes=cache.nbytes, attend_peak_bytes=int(peak),
                           tile_bytes=2 * kv_heads * min(tile, layer.get_seq_length()) * D * 4,  # K and V tiles as float32
                           layer_fp32_kv_bytes=2 * kv_heads * layer.get_seq_length() * D * 4)
            else:
                row["cache_bytes"] = sum(la.keys.numel() * la.keys.element_size() * 2 for la in cache.layers)
            rows[name] = row
            print(f"{T:>6} {name:>16}: {row['ms_per_token']:8.1f} ms/token  x{row['ratio_to_dynamic']:.2f}", flush=True)
        result["contexts"][str(T)] = rows
        write_json(args.out, result)
        del caches, dyn
    return result


if __name__ == "__main__":
    main()
