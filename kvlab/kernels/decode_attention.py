"""Decode attention that reads a quantized KV cache directly (split-KV / flash-decoding).

One new query token per sequence attends over that sequence's cached keys and
values. The cache stays in its storage format — fp16/bf16, FP8 (e4m3 or e5m2),
INT8, or INT4 packed two per byte — and each program dequantizes one tile of
``BLOCK_N`` tokens at a time in registers: codes -> float32, times the scale
(plus the zero point for asymmetric formats). No full-precision copy of the
cache is ever written to memory; that is the point of fusing.

Work split (flash-decoding, Dao et al. 2023, "Flash-Decoding for long-context
inference"): the grid is ``(batch, kv_head, split)``. Each program takes one KV
head, all the query heads that share it (grouped-query attention), and one slice
of the sequence, and runs the online softmax over its slice (Milakov &
Gimelshein 2018): it keeps a running max ``m``, a running sum ``l`` of
``exp(s - m)``, and an accumulator of ``exp(s - m) * v``, rescaling both by
``exp(m_old - m_new)`` whenever the max grows. It writes its partial output
``acc / l`` and its log-sum-exp ``m + log(l)``. A second small kernel merges the
splits: ``out = sum_s exp(lse_s - lse) * out_s`` with ``lse = logsumexp_s(lse_s)``.
A long single sequence therefore still spreads over many programs.

Storage layout (:class:`kvlab.storage.KVStore`, which the cache holds and hands here as is):

* codes ``[batch, kv_heads, capacity, head_dim]`` (``head_dim // 2`` bytes for INT4,
  element ``2i`` in the low nibble);
* scales (and zeros) ``[batch, kv_heads, capacity, n_groups]`` for per-token or
  per-group formats (``n_groups = head_dim // group_size``), or one value per
  tensor (``scale_mode = "tensor"``);
* integer codes are unsigned; symmetric formats store ``q + 2^(bits-1)``.

``decode_attention_reference`` (in :mod:`kvlab.kernels.reference`) is the plain-torch
reference the tests compare against; ``attend_tiles`` there is this algorithm in torch.
"""

from __future__ import annotations

import math

import torch

from . import HAVE_TRITON, tl, triton  # kvlab.kernels sets up the interpreter first

if not HAVE_TRITON:
    raise ImportError("triton is not installed: the decode kernel is unavailable (the torch reference still is)")

from kvlab.layout import Kind, ScaleMode
from kvlab.storage import KVStore, kernel_args

from .packing import int4_codes
from .reference import decode_attention_reference, split_plan  # noqa: F401  (the reference re-exported beside the kernel)

# kvlab.layout's kinds and scale modes as compile-time constants the jit functions can read
INT8: tl.constexpr = tl.constexpr(int(Kind.INT8))
INT4: tl.constexpr = tl.constexpr(int(Kind.INT4))
E4M3_BYTES: tl.constexpr = tl.constexpr(int(Kind.FP8_E4M3_BYTES))
E5M2_BYTES: tl.constexpr = tl.constexpr(int(Kind.FP8_E5M2_BYTES))
PER_TENSOR: tl.constexpr = tl.constexpr(int(ScaleMode.TENSOR))
PER_TOKEN: tl.constexpr = tl.constexpr(int(ScaleMode.TOKEN))

# --------------------------------------------------------------------------- kernels


@triton.jit
def _fp8_bits_to_f32(b, E4M3: tl.constexpr):
    """FP8 codes read as bytes -> float32 with integer operations, for GPUs without FP8 conversions (sm_80).

    E5M2 is the top byte of an fp16. For E4M3, the sign moved to bit 15 and the exponent and mantissa
    to bits 13..7 of an fp16 give x * 2^-8 exactly (E4M3's exponent bias is 7, fp16's 15), subnormals
    included; 0x7F and 0xFF are E4M3's NaN.
    """
    h = b.to(tl.uint16)
    if E4M3:
        bits = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
        x = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        x = tl.where((h & 0x7F) == 0x7F, float("nan"), x)
    else:
        x = (h << 8).to(tl.float16, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _load_tile(codes_ptr, scale_ptr, zero_ptr, base_row, offs_n, offs_d, mask_n,
               stride_t, s_stride_t, N_GROUPS: tl.constexpr, GROUP: tl.constexpr,
               KIND: tl.constexpr, SYMMETRIC: tl.constexpr, SCALE_MODE: tl.constexpr):
    """Load BLOCK_N tokens x HEAD_DIM values of K or V and dequantize them to float32.

    KIND and SCALE_MODE: :class:`kvlab.layout.Kind` and :class:`kvlab.layout.ScaleMode`.
    """
    rows = base_row + offs_n  # token index inside this (batch, head)
    if KIND == INT4:  # two codes per byte (kernels.packing: kvlab.layout's nibble order)
        x = int4_codes(codes_ptr, rows, offs_d, stride_t, mask_n).to(tl.float32)
    else:
        raw = tl.load(codes_ptr + rows[:, None] * stride_t + offs_d[None, :], mask=mask_n[:, None])
        if KIND == E4M3_BYTES or KIND == E5M2_BYTES:
            x = _fp8_bits_to_f32(raw, KIND == E4M3_BYTES)
        else:
            x = raw.to(tl.float32)
    # Rows past the end were not loaded: make them exact zeros (0 * p stays 0, never NaN).
    x = tl.where(mask_n[:, None], x, 0.0)
    IS_INT: tl.constexpr = KIND == INT8 or KIND == INT4
    if IS_INT:
        if SYMMETRIC:  # unsigned storage: subtract the 2^(bits-1) offset
            x = x - (128.0 if KIND == INT8 else 8.0)
    if SCALE_MODE == PER_TENSOR:  # one scale for the whole tensor
        x = x * tl.load(scale_ptr).to(tl.float32)
        if IS_INT and not SYMMETRIC:
            x = x + tl.load(zero_ptr).to(tl.float32)
    elif SCALE_MODE == PER_TOKEN:  # a scale per token per group of GROUP channels
        sp = rows[:, None] * s_stride_t + (offs_d // GROUP)[None, :]
        x = x * tl.load(scale_ptr + sp, mask=mask_n[:, None], other=1.0).to(tl.float32)
        if IS_INT and not SYMMETRIC:
            x = x + tl.load(zero_ptr + sp, mask=mask_n[:, None], other=0.0).to(tl.float32)
    return x


@triton.jit
def _decode_split_kernel(
    Q, K, KS, KZ, V, VS, VZ, SEQ_LENS, O_PART, LSE_PART,
    scaling,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt, stride_ksb, stride_ksh, stride_kst,
    stride_vb, stride_vh, stride_vt, stride_vsb, stride_vsh, stride_vst,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    TOKENS_PER_SPLIT,
    QUERIES_PER_KV: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    K_KIND: tl.constexpr, K_SYM: tl.constexpr, K_SCALE_MODE: tl.constexpr, K_GROUPS: tl.constexpr,
    V_KIND: tl.constexpr, V_SYM: tl.constexpr, V_SCALE_MODE: tl.constexpr, V_GROUPS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start = split * TOKENS_PER_SPLIT
    stop = tl.minimum(start + TOKENS_PER_SPLIT, seq_len)

    offs_g = tl.arange(0, BLOCK_G)  # query heads sharing this KV head (padded to BLOCK_G >= 16 for tl.dot)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < QUERIES_PER_KV
    qh = kvh * QUERIES_PER_KV + offs_g
    q = tl.load(Q + b * stride_qb + qh[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    q = (q.to(tl.float32) * scaling)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    ks_base = KS + b * stride_ksb + kvh * stride_ksh
    vs_base = VS + b * stride_vsb + kvh * stride_vsh
    kz_base = KZ + b * stride_ksb + kvh * stride_ksh
    vz_base = VZ + b * stride_vsb + kvh * stride_vsh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        mask_n = (n0 + offs_n) < stop
        k = _load_tile(k_base, ks_base, kz_base, n0, offs_n, offs_d, mask_n, stride_kt, stride_kst,
                       K_GROUPS, HEAD_DIM // K_GROUPS, K_KIND, K_SYM, K_SCALE_MODE)
        s = tl.dot(q, tl.trans(k))  # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)  # rescale what was accumulated under the old max
        p = tl.exp(s - m_new[:, None])
        v = _load_tile(v_base, vs_base, vz_base, n0, offs_n, offs_d, mask_n, stride_vt, stride_vst,
                       V_GROUPS, HEAD_DIM // V_GROUPS, V_KIND, V_SYM, V_SCALE_MODE)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    # Empty splits (start >= seq_len) write lse = -inf so the merge ignores them.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(O_PART + b * stride_ob + qh[:, None] * stride_oh + split * stride_os + offs_d[None, :], out,
             mask=mask_g[:, None])
    tl.store(LSE_PART + b * stride_lb + qh * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _merge_kernel(O_PART, LSE_PART, OUT, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  stride_outb, stride_outh, N_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    """out = sum_s softmax(lse)_s * out_s: combine the splits of one (batch, query head)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < N_SPLITS
    lse = tl.load(LSE_PART + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - m)
    w = w / tl.sum(w, axis=0)
    o = tl.load(O_PART + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                mask=mask_s[:, None], other=0.0)
    tl.store(OUT + b * stride_outb + h * stride_outh + offs_d, tl.sum(o * w[:, None], axis=0))


def _strides(t: torch.Tensor | None, n: int):
    return (0,) * n if t is None or t.numel() == 1 else tuple(t.stride()[:n])


def fp8_needs_bits(device) -> bool:
    """True where FP8 codes must be read as bytes: CUDA GPUs before sm_89 (Ada) lack FP8 conversions."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def _codes(store: KVStore, kind: Kind):
    """The codes pointer the kernel gets: FP8 read as bytes is the same buffer viewed as uint8."""
    return store.codes.view(torch.uint8) if kind in (Kind.FP8_E4M3_BYTES, Kind.FP8_E5M2_BYTES) else store.codes


def decode_attention(q: torch.Tensor, k: KVStore, v: KVStore, seq_lens: torch.Tensor,
                     scaling: float | None = None, *, block_n: int = 32, num_splits: int | None = None,
                     return_lse: bool = False, fp8_bits: bool | None = None):
    """Attention of one query token per sequence over a quantized cache.

    ``q``: ``[batch, q_heads, head_dim]``; ``k``, ``v``: :class:`kvlab.storage.KVStore`;
    ``seq_lens``: ``[batch]`` tokens in each sequence (each at most the tokens stored).
    Returns float32 ``[batch, q_heads, head_dim]`` (and the log-sum-exp of the logits per
    head with ``return_lse``). ``fp8_bits``: read FP8 codes as bytes and convert them with integer
    operations (default: only on GPUs without FP8 conversions, see :func:`fp8_needs_bits`).
    """
    bits = fp8_needs_bits(q.device) if fp8_bits is None else bool(fp8_bits)
    ka, va = _validate(q, k, v, seq_lens, block_n, num_splits, bits)
    if scaling is not None and (isinstance(scaling, bool) or not isinstance(scaling, int | float)
                                or not math.isfinite(scaling) or scaling <= 0):
        raise ValueError(f"scaling must be a finite positive number (or None for head_dim**-0.5), got {scaling!r}")
    k_codes, v_codes = _codes(k, ka["kind"]), _codes(v, va["kind"])
    q = q.contiguous()
    B, Hq, D = q.shape
    Hkv = k.codes.shape[1]
    group = Hq // Hkv
    scaling = D**-0.5 if scaling is None else float(scaling)
    max_len = int(seq_lens.max())
    num_splits, per_split = split_plan(max_len, B, Hkv, block_n, num_splits)  # flash-decoding: splits of whole tiles
    dev = q.device
    o_part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=dev)
    lse_part = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    ks, kz = (k.scale if k.scale is not None else dummy), (k.zero if k.zero is not None else dummy)
    vs, vz = (v.scale if v.scale is not None else dummy), (v.zero if v.zero is not None else dummy)
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_codes, ks, kz, v_codes, vs, vz, seq_lens, o_part, lse_part,
        scaling,
        q.stride(0), q.stride(1),
        *k.codes.stride()[:3], *_strides(k.scale, 3),
        *v.codes.stride()[:3], *_strides(v.scale, 3),
        *o_part.stride()[:3], *lse_part.stride()[:2],
        per_split,
        QUERIES_PER_KV=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, BLOCK_N=block_n,
        K_KIND=ka["kind"], K_SYM=ka["symmetric"], K_SCALE_MODE=ka["scale_mode"], K_GROUPS=ka["n_groups"],
        V_KIND=va["kind"], V_SYM=va["symmetric"], V_SCALE_MODE=va["scale_mode"], V_GROUPS=va["n_groups"],
    )
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=dev)
    _merge_kernel[(B, Hq)](
        o_part, lse_part, out, *o_part.stride()[:3], *lse_part.stride()[:2], *out.stride()[:2],
        N_SPLITS=num_splits, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=D,
    )
    if return_lse:
        return out, torch.logsumexp(lse_part, dim=-1)
    return out


def _validate(q, k, v, seq_lens, block_n, num_splits, fp8_bits=False):
    """Check everything the kernel would otherwise trust; return the stores' kernel constants."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a float tensor [batch, q_heads, head_dim], got {getattr(q, 'shape', type(q))}")
    B, Hq, D = q.shape
    if D & (D - 1) or D < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
    args = []
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, KVStore):
            raise TypeError(f"{name} must be a kvlab.storage.KVStore, got {type(t).__name__}")
        if t.codes is None or t.tokens == 0:
            raise ValueError(f"{name} holds no tokens")
        args.append(kernel_args(t, fp8_bits))  # raises for formats the kernel does not read
        if t.head_dim != D:
            raise ValueError(f"{name} head_dim {t.head_dim} != q head_dim {D}")
        if t.codes.shape[0] != B:
            raise ValueError(f"{name} batch {t.codes.shape[0]} != q batch {B}")
        if t.codes.device != q.device:
            raise ValueError(f"{name} is on {t.codes.device}, q on {q.device}")
        if t.codes.stride(-1) != 1:
            raise ValueError(f"{name} codes must be contiguous along head_dim (stride {t.codes.stride(-1)})")
        if args[-1]["scale_mode"] == ScaleMode.TOKEN:  # per-token scales must exist for every token the kernel may read
            if t.scale.shape[:3] != t.codes.shape[:3] or t.scale.stride(-1) != 1:
                raise ValueError(f"{name} scales {tuple(t.scale.shape)} do not cover its codes "
                                 f"{tuple(t.codes.shape)} token for token")
            if D % args[-1]["n_groups"]:
                raise ValueError(f"{name}: {args[-1]['n_groups']} scale groups do not divide head_dim {D}")
    if k.codes.shape[:2] != v.codes.shape[:2]:
        raise ValueError(f"k and v differ in batch or heads: {tuple(k.codes.shape[:2])} vs {tuple(v.codes.shape[:2])}")
    Hkv = k.codes.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.shape != (B,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be an integer tensor of shape ({B},)")
    if seq_lens.device != q.device:
        raise ValueError(f"seq_lens is on {seq_lens.device}, q on {q.device}")
    held = min(k.tokens, v.tokens)
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > held:
        raise ValueError(f"seq_lens must be in [1, {held}] (the tokens both stores hold), got {seq_lens.tolist()}")
    if not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive integer or None, got {num_splits!r}")
    return args


def max_error_vs_reference(formats, *, lengths=(300, 17), kv_heads: int = 2, q_heads: int = 8, head_dim: int = 64,
                           device="cpu", seed: int = 0) -> dict[str, float]:
    """Largest ``|kernel - reference|`` per format on one random cache (chapter 3.3).

    Both sides read the same :class:`KVStore` codes, so the difference is the kernel's own
    arithmetic, not the format's quantization error. ``lengths`` gives one sequence per entry.
    """
    from kvlab.formats import get_format

    if not formats:
        raise ValueError("formats must name at least one KV format")
    if not lengths or not all(isinstance(n, int) and n > 0 for n in lengths):
        raise ValueError(f"lengths must be positive token counts, one per sequence, got {lengths!r}")
    g = torch.Generator().manual_seed(seed)
    T, B = max(lengths), len(lengths)
    k, v = (torch.randn(B, kv_heads, T, head_dim, generator=g).to(device) for _ in range(2))
    q = torch.randn(B, q_heads, head_dim, generator=g).to(device)
    lens = torch.tensor(list(lengths), dtype=torch.int32, device=device)
    out = {}
    for f in formats:
        fmt = get_format(f)
        kq, vq = KVStore.from_tensor(k, fmt.key), KVStore.from_tensor(v, fmt.value)  # what the cache holds
        out[str(f)] = (decode_attention(q, kq, vq, lens) - decode_attention_reference(q, kq, vq, lens)).abs().max().item()
    return out
