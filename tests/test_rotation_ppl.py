"""scripts/rotation_ppl.py: refuses bad arguments before it loads a model (the run itself is in data/results)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("rotation_ppl", ROOT / "scripts" / "rotation_ppl.py")
rotation_ppl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rotation_ppl)


@pytest.mark.parametrize("args, needle", [(["--windows", "0"], "--windows"), (["--windows", "65"], "--windows"),
                                          (["--formats", "fp32", "int3_nonsense"], "--formats"),
                                          (["--out", "/no/such/folder/r.json"], "--out")])
def test_bad_arguments_get_one_clear_error(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        rotation_ppl.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err


def test_the_shipped_results_cover_the_formats_the_script_sweeps():
    import json

    from kvlab.results import ROTATION_PPLS

    assert ROTATION_PPLS["smollm2-135m"].is_file()
    for model, path in ROTATION_PPLS.items():
        if path.is_file():
            doc = json.loads(path.read_text())
            assert doc["model"] == model and doc["formats"] == rotation_ppl.FORMATS
            assert all(len(v) == len(doc["tokens"]) for v in doc["nll"].values())
