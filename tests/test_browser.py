"""A person's view of chapter 1: JupyterLab in headless Chromium, driven by Playwright.

Starts JupyterLab on localhost, opens ``01_cache_budget.ipynb``, runs every
cell, moves the batch and context sliders by typing into their readouts, and
checks that the plotly FigureWidget's data changed in the page. A screenshot
lands in ``artifacts/`` (git-ignored).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make browser-deps)"),
]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    port, token = free_port(), secrets.token_hex(16)
    home = tmp_path_factory.mktemp("jupyter")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "JUPYTER_CONFIG_DIR": str(home / "cfg"),
                        "JUPYTER_RUNTIME_DIR": str(home / "rt"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "ws")}
    # Work on a copy so the committed notebook never gets outputs written into it.
    nbdir = home / "notebooks"
    shutil.copytree(ROOT / "notebooks", nbdir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", "--allow-root", f"--notebook-dir={nbdir}", "--ServerApp.open_browser=False",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(home / "lab.log", "w"),
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=1)
            break
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("JupyterLab did not start:\n" + (home / "lab.log").read_text()[-2000:])
    yield url, token
    proc.terminate()
    proc.wait(timeout=20)


def figure_value(page, nth: int, trace: int, axis: str):
    return page.evaluate(
        "([n, t, a]) => { const p = document.querySelectorAll('.js-plotly-plot')[n];"
        " return p && p.data && p.data[t] ? Array.from(p.data[t][a]) : null; }",
        [nth, trace, axis],
    )


def plot_index(page, title: str) -> int:
    """The index, among the page's plotly figures, of the one whose title starts with ``title`` (figures added above
    the explorer must not break the test)."""
    i = page.evaluate(
        "(t) => Array.from(document.querySelectorAll('.js-plotly-plot'))"
        ".findIndex(p => p.layout && p.layout.title && String(p.layout.title.text || '').startsWith(t))", title)
    assert i >= 0, f"no figure titled {title!r}"
    return i


def set_slider(page, label: str, value: str):
    """Type a value into an ipywidgets slider's editable readout, as a person can."""
    slider = page.locator(".widget-slider", has=page.locator("label", has_text=label)).first
    readout = slider.locator(".widget-readout")
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(value)
    page.keyboard.press("Enter")


def test_chapter1_sliders_move_the_figure(lab):
    from playwright.sync_api import sync_playwright

    url, token = lab
    out = ROOT / "artifacts"
    out.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            _drive_chapter1(page, url, token, out)
        except Exception:
            page.screenshot(path=str(out / "chapter1_failure.png"))  # what the browser showed when it failed
            raise
        finally:
            browser.close()


def _drive_chapter1(page, url, token, out):
    """Open chapter 1, run it, move two sliders, check the figures followed."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"{url}/lab/tree/01_cache_budget.ipynb?token={token}")
    page.wait_for_selector(".jp-Notebook", timeout=60_000)
    # A fresh JupyterLab may ask which kernel to start: accept the notebook's own (Python 3).
    try:
        page.locator(".jp-Dialog").get_by_role("button", name="Select").click(timeout=15_000)
    except PlaywrightTimeout:
        pass
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                           ".jp-Toolbar-kernelStatus", timeout=60_000)
    page.get_by_role("menuitem", name="Run").click()
    page.get_by_text("Run All Cells", exact=True).click()
    # The explorer's sliders appear once its cell has run.
    page.wait_for_selector(".widget-slider .widget-readout", timeout=180_000)
    page.wait_for_function(
        "() => Array.from(document.querySelectorAll('.js-plotly-plot')).some(p => p.layout && p.layout.title && "
        "String(p.layout.title.text || '').startsWith('Most concurrent'))", timeout=120_000)
    # The explorer's two figures: the memory bar (weights, engine reserve, KV cache, free) and the concurrency curves.
    mem, curves = plot_index(page, "Memory per GPU"), plot_index(page, "Most concurrent")
    page.wait_for_function(
        "(m) => { const p = document.querySelectorAll('.js-plotly-plot')[m]; return p && p.data && p.data.length == 4; }",
        arg=mem, timeout=60_000)
    # Let every cell finish (the cell after the explorer sets batch and puts it back).
    page.wait_for_function(
        "() => !Array.from(document.querySelectorAll('.jp-InputArea-prompt')).some(e => e.textContent.includes('*'))",
        timeout=300_000)
    cache_before = figure_value(page, mem, 2, "x")
    marker_before = figure_value(page, curves, 5, "x")  # trace 5: the "you are here" marker
    set_slider(page, "batch", "64")
    page.wait_for_function(
        "([m, b]) => { const p = document.querySelectorAll('.js-plotly-plot')[m]; return p.data[2].x[0] != b; }",
        arg=[mem, cache_before[0]], timeout=30_000)
    cache_after = figure_value(page, mem, 2, "x")
    assert cache_after[0] == pytest.approx(4 * cache_before[0]), (cache_before, cache_after)

    set_slider(page, "context", "131072")
    page.wait_for_function(
        "([m, b]) => { const p = document.querySelectorAll('.js-plotly-plot')[m]; return p.data[2].x[0] != b; }",
        arg=[mem, cache_after[0]], timeout=30_000)
    assert figure_value(page, mem, 2, "x")[0] == pytest.approx(4 * cache_after[0])
    page.wait_for_function(  # the curve figure updates in its own message: wait for it too
        "([c, b]) => { const p = document.querySelectorAll('.js-plotly-plot')[c]; return p.data[5].x[0] != b; }",
        arg=[curves, marker_before[0]], timeout=30_000)
    marker_after = figure_value(page, curves, 5, "x")
    assert marker_after != marker_before and marker_after[0] == pytest.approx(131072, rel=0.01)
    page.screenshot(path=str(out / "chapter1_explorer.png"), full_page=False)
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert "Traceback" not in " ".join(errors.all_inner_texts())
