import subprocess
import sys

import pytest
import torch

from kvlab.paths import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the refusal on a machine without CUDA")
@pytest.mark.slow  # seconds of waiting: in make test, not make quick
def test_make_gpu_refuses_clearly_without_cuda():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("gpu_check.py: error: make gpu needs a CUDA GPU") and len(r.stderr.splitlines()) == 1
