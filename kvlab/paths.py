"""Where the workbook's shipped files live (one definition for every module)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "data"
PRESETS_DIR = DATA_DIR / "presets"  # model configs and gpus.json
RESULTS_DIR = DATA_DIR / "results"  # precomputed sweeps and benchmark results
MODEL_DIR = DATA_DIR / "model"  # kvlab-tiny, the unit-test model
CORPUS_DIR = DATA_DIR / "corpus"
