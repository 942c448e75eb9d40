"""Where the workbook's shipped files live (one definition for every module)."""

import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "data"
PRESETS_DIR = DATA_DIR / "presets"  # model configs and gpus.json
RESULTS_DIR = DATA_DIR / "results"  # precomputed sweeps and benchmark results
MODEL_DIR = DATA_DIR / "model"  # kvlab-tiny, the unit-test model
CORPUS_DIR = DATA_DIR / "corpus"


def write_json(path: str | Path, doc) -> None:
    """Write ``doc`` as JSON to ``path`` atomically (a temporary file in the same folder, then a rename),
    so an interrupted run never leaves a half-written result."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
