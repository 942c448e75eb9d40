"""What this machine can run: torch, CUDA, Triton (native or interpreter), the workbook's models."""

from __future__ import annotations

import importlib.util
import os
import platform

from .paths import MODEL_DIR


def cpu_model() -> str:
    """The processor's name (from /proc/cpuinfo where there is one), for recording where a measurement ran."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(torch_threads: int | None = None) -> str:
    """Where a measurement ran, as every shipped result records it: architecture, processor, cores (and the torch
    threads it used, when given)."""
    where = f"{platform.machine()} {cpu_model()}, {os.cpu_count()} cores"
    return where if torch_threads is None else f"{where}, torch {torch_threads} threads"


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def triton_mode() -> str:
    """``"native"`` on a CUDA GPU, ``"interpreter"`` on a CPU, ``"unavailable"`` without triton."""
    if not has_triton():
        return "unavailable"
    if has_cuda() and os.environ.get("TRITON_INTERPRET") != "1":
        return "native"
    return "interpreter"


def _smollm2_state() -> str:
    from .models import cache_dir, smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError:
        return "not installed (make lab / make test install it)"
    return "ready" if (cache_dir() / "smollm2-135m" / "model.safetensors").exists() else "installed, converted on first load"


def report() -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if has_cuda() else "none"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda GPU": gpu,
        "triton": (importlib.import_module("triton").__version__ if has_triton() else "not installed"),
        "triton mode": triton_mode(),
        "SmolLM2-135M-Instruct (chapters)": _smollm2_state(),
        "kvlab-tiny (unit tests)": "present" if (MODEL_DIR / "config.json").exists() else "missing",
        "cpu cores": os.cpu_count(),
    }
