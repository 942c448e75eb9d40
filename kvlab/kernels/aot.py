"""Compile every kernel variant for real NVIDIA GPUs, ahead of time, on a machine without one.

Triton's interpreter (how the kernels run on a CPU) accepts programs a GPU compiler rejects, so the
tests also compile each kernel the way a GPU would, with the compiler and ``ptxas`` that ship in the
triton wheel: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``. For each variant
:func:`compile_variant` reports whether it compiled, the shared memory it needs, and whether its PTX
uses local memory (register spills).

Import this module with ``TRITON_INTERPRET=0`` in the environment (``tests/test_aot.py`` runs it in a
subprocess): under the interpreter the kernels are not compilable functions.

What a GPU lacks is a documented fallback, not a failure: Triton has no FP8 E4M3 type before sm_89
(Ada; sm_80 offers only E5M2 and a non-standard E4M3 with bias 15), so ``decode_attention`` reads FP8
codes as bytes on those GPUs (``Kind.FP8_E4M3_BYTES`` / ``FP8_E5M2_BYTES``) and :class:`kvlab.storage.KVStore` quantizes FP8 on the host
there instead of with the append kernel.

    TRITON_INTERPRET=0 python -m kvlab.kernels.aot [out.json]   # the whole matrix, as JSON
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvlab.layout import Kind, ScaleMode

from . import decode_attention as da
from . import quantize_append as qa

ARCHS = {80: "A100 (sm_80)", 89: "L4 / RTX 4090 (sm_89)", 90: "H100 / H200 (sm_90)"}
CODE_TYPES = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "fp8_e4m3": "*fp8e4nv", "fp8_e5m2": "*fp8e5", "bytes": "*u8"}
# a layout's code dtype (torch's name) -> the key above; scale dtype -> Triton pointer type
CODE_KEYS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8_e4m3",
             "float8_e5m2": "fp8_e5m2", "uint8": "bytes"}
SCALE_TYPES = {"float16": "*fp16", "float32": "*fp32"}
FP8_NATIVE_MIN_ARCH = 89


@dataclass(frozen=True)
class Variant:
    """One compiled specialisation of a kernel."""

    kernel: str  # "split", "merge" or "append"
    name: str
    codes: str = "fp16"  # key of CODE_TYPES
    kind: Kind = Kind.FLOAT
    symmetric: bool = True
    scale_mode: ScaleMode = ScaleMode.NONE
    groups: int = 1
    scale: str = "*fp16"
    head_dim: int = 128
    gqa: int = 4

    @property
    def needs_e4m3(self) -> bool:
        return self.codes == "fp8_e4m3"


def _split(v: Variant):
    s = {"Q": "*fp32", "K": CODE_TYPES[v.codes], "KS": v.scale, "KZ": v.scale, "V": CODE_TYPES[v.codes],
         "VS": v.scale, "VZ": v.scale, "SEQ_LENS": "*i32", "O_PART": "*fp32", "LSE_PART": "*fp32",
         "scaling": "fp32"}
    for n in ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_kt", "stride_ksb", "stride_ksh",
              "stride_kst", "stride_vb", "stride_vh", "stride_vt", "stride_vsb", "stride_vsh", "stride_vst",
              "stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh", "TOKENS_PER_SPLIT"):
        s[n] = "i32"
    c = dict(QUERIES_PER_KV=v.gqa, BLOCK_G=max(16, triton.next_power_of_2(v.gqa)), HEAD_DIM=v.head_dim, BLOCK_N=32,
             K_KIND=v.kind, K_SYM=v.symmetric, K_SCALE_MODE=v.scale_mode, K_GROUPS=v.groups,
             V_KIND=v.kind, V_SYM=v.symmetric, V_SCALE_MODE=v.scale_mode, V_GROUPS=v.groups)
    return da._decode_split_kernel, s, c


def _merge(v: Variant):
    s = {n: "*fp32" for n in ("O_PART", "LSE_PART", "OUT")}
    s.update({n: "i32" for n in ("stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh", "stride_outb",
                                 "stride_outh")})
    return da._merge_kernel, s, dict(N_SPLITS=8, BLOCK_S=8, HEAD_DIM=v.head_dim)


def _append(v: Variant):
    s = {"X": "*fp32", "CODES": CODE_TYPES[v.codes], "SCALE": v.scale,
         "ZERO": v.scale, "POS": "*i32"}
    s.update({n: "i32" for n in ("stride_xb", "stride_xh", "stride_xt", "stride_cb", "stride_ch", "stride_ct",
                                 "stride_sb", "stride_sh", "stride_st")})
    c = dict(HEAD_DIM=v.head_dim, N_GROUPS=v.groups, KIND=v.kind, SYMMETRIC=v.symmetric, SCALE_MODE=v.scale_mode,
             FP8_MAX=448.0 if v.codes == "fp8_e4m3" else 57344.0 if v.codes == "fp8_e5m2" else 1.0)
    return qa._append_kernel, s, c


HEAD_DIMS = (64, 128)  # the presets' specialisations are compiled at both


def spec_key(v: Variant) -> tuple:
    """What a variant compiles (its name aside)."""
    return (v.kernel, v.codes, v.kind, v.symmetric, v.scale_mode, v.groups, v.scale, v.head_dim, v.gqa)


def layout_variant(lay, kernel: str = "split") -> Variant:
    """The variant that compiles ``lay`` (a :class:`kvlab.layout.Layout` the kernels read), unnamed."""
    c = lay.kernel_constants()
    return Variant(kernel, "", CODE_KEYS[lay.code_dtype], c["kind"], c["symmetric"], c["scale_mode"], c["n_groups"],
                   SCALE_TYPES.get(lay.scale_dtype, "*fp16"), lay.head_dim)


def preset_variants() -> list[Variant]:
    """Every specialisation a kvlab preset produces at head_dim 64 and 128, derived from the format itself
    (:class:`kvlab.layout.Layout`): the split kernel for each, and the append kernel where it applies
    (not for q4_0's full-range rounding, which ``KVStore.append`` does on the host)."""
    from kvlab.formats import format_names, get_format
    from kvlab.layout import Layout, kernel_readable

    found: dict[tuple, tuple[Variant, list[str]]] = {}
    for name in format_names():
        f = get_format(name)
        for q in dict.fromkeys((f.key, f.value)):
            if not kernel_readable(q):
                continue
            for hd in HEAD_DIMS:
                if q.granularity == "group" and q.group_axis == "channel" and hd % q.group_size:
                    continue
                for k in ["split"] + ([] if q.full_range else ["append"]):
                    v = layout_variant(Layout(q, hd), k)
                    found.setdefault(spec_key(v), (v, []))[1].append(name)
    return [replace(v, name=f"{v.kernel} {'/'.join(dict.fromkeys(names))} (head_dim {v.head_dim})")
            for v, names in found.values()]


def variants() -> list[Variant]:
    """Every kernel specialisation kvlab's presets produce (per-tensor, per-token and grouped scales, every
    element type, two head_dims and three GQA ratios where they change the code)."""
    split = [
        Variant("split", "fp16", "fp16"), Variant("split", "bf16", "bf16"),
        Variant("split", "fp8_e4m3 per tensor", "fp8_e4m3", Kind.FP8, scale_mode=ScaleMode.TENSOR, scale="*fp32"),
        Variant("split", "fp8_e5m2 per tensor", "fp8_e5m2", Kind.FP8, scale_mode=ScaleMode.TENSOR, scale="*fp32"),
        Variant("split", "fp8_e4m3 per token", "fp8_e4m3", Kind.FP8, scale_mode=ScaleMode.TOKEN),
        Variant("split", "fp8_e4m3 as bytes", "bytes", Kind.FP8_E4M3_BYTES, scale_mode=ScaleMode.TENSOR, scale="*fp32"),
        Variant("split", "fp8_e5m2 as bytes", "bytes", Kind.FP8_E5M2_BYTES, scale_mode=ScaleMode.TENSOR, scale="*fp32"),
        Variant("split", "int8 per token", "bytes", Kind.INT8, scale_mode=ScaleMode.TOKEN),
        Variant("split", "int8 per tensor", "bytes", Kind.INT8, scale_mode=ScaleMode.TENSOR),
        Variant("split", "int4 asym g64 (int4)", "bytes", Kind.INT4, False, ScaleMode.TOKEN, groups=2),
        Variant("split", "int4 per token", "bytes", Kind.INT4, True, ScaleMode.TOKEN),
        Variant("split", "int4 per tensor", "bytes", Kind.INT4, True, ScaleMode.TENSOR),
        Variant("split", "q4_0 (g32)", "bytes", Kind.INT4, True, ScaleMode.TOKEN, groups=4),
        Variant("split", "int4 asym, head_dim 64, MHA", "bytes", Kind.INT4, False, ScaleMode.TOKEN, head_dim=64, gqa=1),
        Variant("split", "fp16, head_dim 64, GQA 8", "fp16", head_dim=64, gqa=8),
        Variant("split", "int8 per token, GQA 8", "bytes", Kind.INT8, scale_mode=ScaleMode.TOKEN, gqa=8),
    ]
    merge = [Variant("merge", "merge, head_dim 128"), Variant("merge", "merge, head_dim 64", head_dim=64)]
    append = [
        Variant("append", "append fp16", "fp16"),
        Variant("append", "append int8 per token", "bytes", Kind.INT8, scale_mode=ScaleMode.TOKEN),
        Variant("append", "append int4 asym g64", "bytes", Kind.INT4, False, ScaleMode.TOKEN, groups=2),
        Variant("append", "append int4 per token", "bytes", Kind.INT4, True, ScaleMode.TOKEN),
        Variant("append", "append fp8_e4m3 per token", "fp8_e4m3", Kind.FP8, scale_mode=ScaleMode.TOKEN),
    ]
    hand = split + merge + append
    have = {spec_key(v) for v in hand}
    return hand + [v for v in preset_variants() if spec_key(v) not in have]


def compile_variant(v: Variant, arch: int) -> dict:
    """Compile ``v`` for ``sm_<arch>``: ``{"ok", "shared_bytes", "local_memory", "error"}``."""
    fn, sig, const = {"split": _split, "merge": _merge, "append": _append}[v.kernel](v)
    for k in const:
        sig[k] = "constexpr"
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", arch, 32))
    except Exception as e:  # the compiler's own error types vary; the message is what matters
        return {"ok": False, "shared_bytes": None, "local_memory": None, "error": str(e).strip().splitlines()[-1][:300]}
    ptx = k.asm["ptx"]
    return {"ok": True, "shared_bytes": int(k.metadata.shared), "local_memory": bool(re.search(r"\.local\s", ptx)),
            "error": None}


def expected_to_fail(v: Variant, arch: int) -> bool:
    """The documented fallback: Triton's FP8 E4M3 type needs sm_89 or newer."""
    return v.needs_e4m3 and arch < FP8_NATIVE_MIN_ARCH


def _row(job: tuple[Variant, int]) -> dict:
    v, arch = job
    return {"kernel": v.kernel, "variant": v.name, "arch": arch, "expected_to_fail": expected_to_fail(v, arch),
            "spec": list(spec_key(v)), **compile_variant(v, arch)}


def matrix(archs=tuple(ARCHS), workers: int | None = None) -> list[dict]:
    """Compile every variant for every architecture, one compiler process per core."""
    import os
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(v, arch) for v in variants() for arch in archs]
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        return [_row(j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_row, jobs, chunksize=4))


def main(argv=None) -> list[dict]:
    import datetime as dt
    import json
    import sys

    argv = sys.argv[1:] if argv is None else argv
    rows = matrix()
    doc = {"what": "every kvlab kernel variant compiled ahead of time for each GPU architecture (no GPU needed): "
                   "ok, shared memory per program, local memory (spills) in the PTX",
           "triton": triton.__version__, "archs": {str(a): n for a, n in ARCHS.items()},
           "date": dt.date.today().isoformat(), "rows": rows}
    text = json.dumps(doc, indent=1)
    if argv:
        with open(argv[0], "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return rows


if __name__ == "__main__":
    main()
