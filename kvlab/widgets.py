"""Interactive panels for the notebooks: ipywidgets controls driving plotly FigureWidgets.

Figures are updated in place (``fig.data[i].x = ...`` inside ``batch_update``),
never re-rendered, so moving a slider only sends the changed arrays to the
browser.
"""

from __future__ import annotations

import math

import ipywidgets as w
import plotly.graph_objects as go

from . import budget as B
from .formats import get_format
from .results import PPL_TOLERANCE
from .simulator import cost_table_html

GiB = B.GIB
CONTEXTS = [2**k for k in range(9, 21)]  # 512 .. 1M tokens
DEFAULT_FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "kivi-2")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")  # FP8 and INT8 cost nearly the same: tell them apart
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x")


SNAPSHOT_NOTE = ("A static snapshot of an interactive panel, as it was when the chapter ran: open the notebook in "
                 "JupyterLab (<code>make lab</code>) to move its controls.")


def snapshot_html(widget) -> str:
    """A widget tree as static HTML: its control settings, its HTML panes and its figures (plotly, no widget manager).

    The figures are drawn by a page that loads ``plotly.min.js`` (the static book does).
    """
    import html

    import plotly.io as pio

    settings, parts = [], []

    def walk(x):
        if isinstance(x, go.FigureWidget):
            parts.append(pio.to_html(go.Figure(x), include_plotlyjs=False, full_html=False))
        elif isinstance(x, w.HTML):
            parts.append(f"<div>{x.value}</div>")
        elif isinstance(x, w.Box):
            for child in x.children:
                walk(child)
        elif isinstance(x, w.ValueWidget) and getattr(x, "description", ""):
            v = x.value
            v = int(v) if isinstance(v, float) and v.is_integer() else v
            settings.append(f"{html.escape(x.description)} = <b>{html.escape(str(v))}</b>")

    walk(widget)
    head = f"<p class='kvlab-snapshot-note'>{SNAPSHOT_NOTE}</p>"
    if settings:
        head += "<p>" + " &middot; ".join(settings) + "</p>"
    return "<div class='kvlab-snapshot'>" + head + "\n".join(parts) + "</div>"


def _choice(panel: str, control: str, value, options):
    """``value`` if it is one of a dropdown's ``options``; else ``ValueError`` naming the panel, the control and the
    allowed values (ipywidgets' own "Invalid selection: value not found" names neither)."""
    options = list(options)
    if isinstance(value, bool) or value not in options:  # True == 1: a yes/no is not a TP size
        raise ValueError(f"{panel}: {control} {value!r} is not one of: {', '.join(map(str, options))}")
    return value


def _in_range(panel: str, control: str, value, low, high, integer: bool = False):
    """``value`` if a slider can show it (``low`` to ``high``); else ``ValueError``: a slider would clamp it silently."""
    ok = not isinstance(value, bool) and isinstance(value, int if integer else int | float) and low <= value <= high
    if not ok:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{panel}: {control} must be {kind} from {low:,} to {high:,}, got {value!r}")
    return value


class _Panel:
    """Displays :meth:`widget` live in Jupyter, with a static snapshot beside it for exports (the book)."""

    def widget(self):  # pragma: no cover - every panel defines it
        raise NotImplementedError

    def _ipython_display_(self):
        from .check import _show

        box = self.widget()
        _show(box, snapshot_html(box))


def memory_breakdown(model, gpu, kv_format, weights_dtype, batch, context, tp=1, memory_utilization=0.9):
    """GiB per GPU of weights, cache and what is left, plus whether it all fits."""
    f = B.fit(model, gpu, weights_dtype, tp=tp, memory_utilization=memory_utilization)
    cache = B.budget(model, batch, context, kv_format, tp=tp).cache_bytes_per_gpu
    total = B.get_gpu(gpu).memory_bytes
    return {
        "weights": f.weights_bytes_per_gpu / GiB,
        "reserve": f.reserve_bytes_per_gpu / GiB,  # the engine's own: activation peak, CUDA graphs, NCCL
        "cache": cache / GiB,
        "free": max(0, total - f.weights_bytes_per_gpu - f.reserve_bytes_per_gpu - cache) / GiB,
        "capacity": total / GiB,
        "usable": f.usable_bytes_per_gpu / GiB,
        "fits": f.weights_fit and cache <= f.free_for_cache_per_gpu,
    }


def concurrency_curves(model, gpu, weights_dtype, formats=DEFAULT_FORMATS, contexts=CONTEXTS, tp=1):
    """``{format: [max concurrent sequences at each context]}``."""
    return {
        f: [B.max_concurrency(model, t, f, gpu, weights_dtype, tp=tp) for t in contexts] for f in formats
    }


class BudgetExplorer(_Panel):
    """Sliders for batch and context, dropdowns for model, GPU, KV format, weights dtype and TP."""

    def __init__(self, model="llama-3.1-70b", gpu="H200", kv_format="bf16", weights_dtype="fp8",
                 batch=16, context=32768, tp=1, formats=DEFAULT_FORMATS):
        P = "BudgetExplorer"
        self.formats = tuple(get_format(f).name for f in formats)  # an unknown name: get_format lists the known ones
        if not self.formats:
            raise ValueError(f"{P}: formats must name at least one KV format")
        _choice(P, "model", model, B.preset_names())
        _choice(P, "gpu", gpu, B.gpus())
        kv_format = _choice(P, "kv_format", get_format(kv_format).name, self.formats)
        _choice(P, "weights_dtype", weights_dtype, ("bf16", "fp8", "int4"))
        _choice(P, "tp", tp, (1, 2, 4, 8))
        _in_range(P, "batch", batch, 1, 256, integer=True)
        _in_range(P, "context", context, CONTEXTS[0], CONTEXTS[-1])
        style = {"description_width": "110px"}
        self.batch = w.IntSlider(value=batch, min=1, max=256, description="batch", style=style,
                                 continuous_update=False)
        self.context = w.FloatLogSlider(value=context, base=2, min=9, max=20, step=0.5,
                                        description="context", style=style, continuous_update=False,
                                        readout_format=".0f")
        self.model = w.Dropdown(options=B.preset_names(), value=model, description="model", style=style)
        self.gpu = w.Dropdown(options=list(B.gpus()), value=gpu, description="GPU", style=style)
        self.kv_format = w.Dropdown(options=list(self.formats), value=kv_format, description="KV format", style=style)
        self.weights_dtype = w.Dropdown(options=["bf16", "fp8", "int4"], value=weights_dtype,
                                        description="weights", style=style)
        self.tp = w.Dropdown(options=[1, 2, 4, 8], value=tp, description="TP ranks", style=style)
        self.status = w.HTML()

        self.bar = go.FigureWidget(
            data=[go.Bar(name=n, x=[0], y=["per GPU"], orientation="h", marker_color=c)
                  for n, c in (("weights", "#636efa"), ("engine reserve", "#ab63fa"), ("KV cache", "#ef553b"),
                               ("free", "#c8d6c8"))],
            layout=dict(barmode="stack", height=220, title="Memory per GPU (GiB = 2^30 bytes; the dashed line is what the engine may use)",
                        xaxis_title="GiB", margin=dict(l=60, r=20, t=40, b=40)),
        )
        self.curve = go.FigureWidget(
            data=[go.Scatter(name=f, x=CONTEXTS, y=[None] * len(CONTEXTS), mode="lines+markers",
                             line=dict(dash=DASHES[i % len(DASHES)]), marker=dict(symbol=SYMBOLS[i % len(SYMBOLS)]))
                  for i, f in enumerate(self.formats)]
            + [go.Scatter(name="you are here", x=[context], y=[batch], mode="markers",
                          marker=dict(size=14, symbol="x", color="black"))],
            layout=dict(height=380, title="Most concurrent sequences that fit, by KV format "
                                          "(a line stops where not one sequence fits)",
                        xaxis=dict(type="log", title="context (tokens)"),
                        yaxis=dict(type="log", title="max concurrent sequences"),
                        margin=dict(l=60, r=20, t=40, b=40)),
        )
        for ctl in (self.batch, self.context, self.model, self.gpu, self.kv_format, self.weights_dtype, self.tp):
            ctl.observe(self.update, names="value")
        self._curve_key = None
        self.update()

    @property
    def args(self):
        return dict(model=self.model.value, gpu=self.gpu.value, kv_format=self.kv_format.value,
                    weights_dtype=self.weights_dtype.value, batch=int(self.batch.value),
                    context=int(round(self.context.value)), tp=int(self.tp.value))

    def update(self, change=None):
        a = self.args
        try:
            m = memory_breakdown(**a)
        except ValueError as e:  # e.g. a TP degree the model's KV heads cannot split into
            self.status.value = f"<span style='color:#b00'>{e}</span>"
            return
        with self.bar.batch_update():
            for trace, key in zip(self.bar.data, ("weights", "reserve", "cache", "free")):
                trace.x = [m[key]]
            self.bar.layout.xaxis.range = [0, max(m["capacity"], m["weights"] + m["cache"]) * 1.02]
            self.bar.layout.shapes = [dict(type="line", x0=m["usable"], x1=m["usable"], y0=-0.45, y1=0.45,
                                           line=dict(color="black", dash="dash", width=2))]
        key = (a["model"], a["gpu"], a["weights_dtype"], a["tp"])
        with self.curve.batch_update():
            if key != self._curve_key:  # the curves depend on these only, not on batch or context
                for trace, ys in zip(self.curve.data, concurrency_curves(
                        a["model"], a["gpu"], a["weights_dtype"], self.formats, tp=a["tp"]).values()):
                    trace.y = [y if y > 0 else None for y in ys]  # log axis: no point where nothing fits
                limit = B.load_shape(a["model"]).max_position_embeddings
                self.curve.layout.shapes = [dict(type="line", x0=limit, x1=limit, yref="paper", y0=0, y1=1,
                                                 line=dict(color="gray", dash="dot"))] if limit else []
                self.curve.layout.annotations = [dict(x=math.log10(limit), yref="paper", y=1, showarrow=False,
                                                      text="context limit", xanchor="right")] if limit else []
                self._curve_key = key
            self.curve.data[-1].x, self.curve.data[-1].y = [a["context"]], [a["batch"]]
        verdict = "fits" if m["fits"] else "does <b>not</b> fit"
        self.status.value = (
            f"{a['batch']} x {a['context']:,} tokens in {a['kv_format']}: cache {m['cache']:,.1f} GiB per GPU, "
            f"weights {m['weights']:,.1f} GiB, engine reserve {m['reserve']:,.2f} GiB, "
            f"usable {m['usable']:,.1f} GiB &rarr; {verdict}."
            + _engine_line(a["kv_format"])
        )

    def widget(self):
        controls = w.VBox([self.batch, self.context, self.model, self.gpu, self.kv_format,
                           self.weights_dtype, self.tp])
        return w.VBox([w.HBox([controls, self.bar]), self.status, self.curve])


def _engine_line(fmt: str) -> str:
    """HTML: how each engine selects ``fmt`` (kvlab formats --engines), or nothing for a non-preset."""
    from .formats import engine_options

    try:
        opts = engine_options(fmt)
    except ValueError:
        return ""
    have = [f"{name}: <code>{flag}</code>" for name, flag in opts.items() if flag]
    return "<br>Select it with " + ("; ".join(have) if have else "no serving engine's documented options") + "."


class PrefixCacheExplorer(_Panel):
    """Dropdowns for GPU, model, KV format and workload; hit rate vs pool size per format, updated in place."""

    def __init__(self, model="llama-3.1-8b", gpu="H100-80GB", workload="rag", kv_format="int4",
                 formats=("bf16", "fp8_e4m3", "int4"), pool_gib=(1, 2, 4, 8, 16, 32), n_requests=200):
        from . import simulator, workloads

        self._sim, self._workloads = simulator, workloads.WORKLOADS
        P = "PrefixCacheExplorer"
        formats = tuple(get_format(f).name for f in formats)
        if not formats:
            raise ValueError(f"{P}: formats must name at least one KV format")
        _choice(P, "model", model, B.preset_names())
        _choice(P, "gpu", gpu, B.gpus())
        _choice(P, "workload", workload, self._workloads)
        kv_format = _choice(P, "kv_format", get_format(kv_format).name, formats)
        pool_gib = list(pool_gib)
        if not pool_gib:
            raise ValueError(f"{P}: pool_gib must list at least one pool size")
        for g in pool_gib:
            _in_range(P, "each pool_gib", g, 1 / 1024, 1 << 20)  # 1 MiB to 1 PiB
        _in_range(P, "n_requests", n_requests, 1, 2_000, integer=True)  # every control replays them: keep it quick
        self.formats, self.pool_gib, self.n = formats, pool_gib, n_requests
        style = {"description_width": "90px"}
        self.model = w.Dropdown(options=B.preset_names(), value=model, description="model", style=style)
        self.gpu = w.Dropdown(options=list(B.gpus()), value=gpu, description="GPU", style=style)
        self.workload = w.Dropdown(options=list(self._workloads), value=workload, description="workload", style=style)
        self.kv_format = w.Dropdown(options=list(self.formats), value=kv_format, description="KV format",
                                    style=style)
        self.table = w.HTML()
        self.fig = go.FigureWidget(
            data=[go.Scatter(name=f, x=self.pool_gib, y=[0] * len(self.pool_gib), mode="lines+markers")
                  for f in self.formats],
            layout=dict(height=360, title="Prefix-cache hit rate vs KV pool size (same bytes, different formats)",
                        xaxis=dict(type="log", title="KV pool (GiB)"), yaxis=dict(title="hit rate", range=[0, 1]),
                        margin=dict(l=60, r=20, t=40, b=40)),
        )
        for ctl in (self.model, self.gpu, self.workload, self.kv_format):
            ctl.observe(self.update, names="value")
        self.update()

    def requests(self):
        kw = {"conversations": max(1, self.n // 5)} if self.workload.value == "chat" else {"n": self.n}
        return self._workloads[self.workload.value](**kw)

    def update(self, change=None):
        reqs = self.requests()
        try:
            curves = self._sim.hit_rate_vs_pool(reqs, self.model.value, self.gpu.value, self.formats, self.pool_gib)
            row = self._sim.cost_table(reqs, self.model.value, self.gpu.value, [self.kv_format.value])[0]
        except ValueError as e:
            self.table.value = f"<span style='color:#b00'>{e}</span>"
            return
        with self.fig.batch_update():
            for trace, ys in zip(self.fig.data, curves.values()):
                trace.y = ys
        self.table.value = (
            f"On one {self.gpu.value} with {self.kv_format.value} KV: {row['num_blocks']:,} blocks, "
            f"hit rate {row['hit_rate']:.1%}, peak concurrency {row['peak_concurrency']}, "
            f"${row['usd_per_m_tokens']:.2f} per million output tokens at "
            f"${B.hourly_price(self.gpu.value):.2f}/GPU-hour (its listed price).")

    def widget(self):
        return w.VBox([w.HBox([self.model, self.gpu]), w.HBox([self.workload, self.kv_format]), self.table, self.fig])


class QuantErrorExplorer(_Panel):
    """Pick a layer, K or V, an element type, a granularity and a group size: SNR and error heatmap update."""

    def __init__(self, capture, layer=0):
        from .formats import Quantizer
        from .metrics import snr_db
        from .quant import fake_quantize

        self._Q, self._snr, self._fq = Quantizer, snr_db, fake_quantize
        from .models import Capture

        if not isinstance(capture, Capture):
            raise TypeError(f"QuantErrorExplorer: capture must be a kvlab.models.Capture (capture_kv gives one), "
                            f"got {type(capture).__name__}")
        if len(capture.keys) != len(capture.values) or any(
                k.dim() != 4 or v.dim() != 4 for k, v in zip(capture.keys, capture.values)):
            raise ValueError("QuantErrorExplorer: capture needs one [batch, heads, tokens, head_dim] key and value "
                             "tensor a layer")
        self.cap = capture
        _in_range("QuantErrorExplorer", "layer", layer, 0, capture.num_layers - 1, integer=True)
        style = {"description_width": "90px"}
        self.layer = w.IntSlider(value=layer, min=0, max=capture.num_layers - 1, description="layer", style=style)
        self.tensor = w.ToggleButtons(options=["keys", "values"], value="keys", description="tensor", style=style)
        self.element = w.Dropdown(options=["int8", "int4", "int2", "float8_e4m3fn"], value="int4",
                                  description="element", style=style)
        self.gran = w.Dropdown(options=["tensor", "token", "channel", "group"], value="token",
                               description="scales per", style=style)
        self.group = w.SelectionSlider(options=[8, 16, 32, 64], value=32, description="group size", style=style)
        self.status = w.HTML()
        self.fig = go.FigureWidget(
            data=[go.Heatmap(z=[[0]], colorscale="Viridis", colorbar=dict(title="|error|"))],
            layout=dict(height=320, title="|x - x_hat| for head 0 (tokens x channels)",
                        xaxis_title="channel", yaxis_title="token", margin=dict(l=60, r=20, t=40, b=40)),
        )
        for ctl in (self.layer, self.tensor, self.element, self.gran, self.group):
            ctl.observe(self.update, names="value")
        self.update()

    def quantizer(self):
        kw = dict(group_size=self.group.value) if self.gran.value == "group" else {}
        sym = self.element.value.startswith("float") or self.gran.value == "tensor"
        return self._Q(self.element.value, self.gran.value, symmetric=sym,
                       scale_bits=32 if self.element.value.startswith("float") else 16, **kw)

    def update(self, change=None):
        self.group.disabled = self.gran.value != "group"  # the slider only means something for groups
        x = (self.cap.keys if self.tensor.value == "keys" else self.cap.values)[self.layer.value]
        try:
            xh = self._fq(x, self.quantizer())
        except ValueError as e:
            self.status.value = f"<span style='color:#b00'>{e}</span>"
            return
        err = (x - xh).abs()[0, 0]
        with self.fig.batch_update():
            self.fig.data[0].z = err.tolist()
        snr = self._snr(x, xh).item()
        snr_text = (f"SNR {snr:.1f} dB" if math.isfinite(snr) else "no error at all (SNR infinite)" if snr == math.inf
                    else "SNR undefined (this tensor is all zeros: no signal)" if not x.any()
                    else "SNR undefined (this tensor holds infinities or NaNs)")
        self.status.value = f"{snr_text}, {self.quantizer().bits_per_element(x.shape[-1]):.3g} bits per element"

    def widget(self):
        return w.VBox([w.HBox([w.VBox([self.layer, self.tensor, self.element, self.gran, self.group]), self.fig]),
                       self.status])


class SweepExplorer(_Panel):
    """Chapter 4's sweep, one format at a time: a dropdown of formats, a haystack toggle, a heatmap.

    The heatmap shows passkey exact match per (needle depth, context length); the line under it
    gives each length's exact match with its 95% interval, beside the full-precision reference.
    """

    def __init__(self, sweep: dict, kv_format: str = "int4_tensor", reference: str = "fp32"):
        from .results import EvalResult

        self._Result = EvalResult
        self.sweep, self.reference = sweep, reference
        names = list(sweep["formats"])
        if kv_format not in names or reference not in names:
            raise ValueError(f"kv_format and reference must be formats of the sweep ({names}), "
                             f"got {kv_format!r} and {reference!r}")
        style = {"description_width": "90px"}
        self.kv_format = w.Dropdown(options=names, value=kv_format, description="KV format", style=style)
        self.haystack = w.ToggleButtons(options=["filler", "prose"], value="filler", description="haystack",
                                        style=style)
        self.status = w.HTML()
        self.fig = go.FigureWidget(
            data=[go.Heatmap(z=[[0]], zmin=0, zmax=1, colorscale="RdYlGn", colorbar=dict(title="exact match"),
                             texttemplate="%{text}", text=[[""]])],
            layout=dict(height=340, xaxis_title="context (tokens)", yaxis_title="needle depth (0 = start)",
                        margin=dict(l=70, r=20, t=50, b=50), xaxis_type="category"))
        for ctl in (self.kv_format, self.haystack):
            ctl.observe(self.update, names="value")
        self.update()

    def result(self, name: str):
        key = "passkey" if self.haystack.value == "filler" else "passkey_prose"
        return self._Result("passkey", self.sweep.get("model", ""), name, self.sweep["formats"][name].get(key, []))

    def update(self, change=None):
        from .results import counts, wilson

        res = self.result(self.kv_format.value)
        if not res.rows:
            self.status.value = (f"<span style='color:#b00'>{self.kv_format.value} was not swept on the "
                                 f"{self.haystack.value} haystack</span>")
            with self.fig.batch_update():
                self.fig.data[0].z, self.fig.data[0].text = [[None]], [[""]]
            return
        grid = res.grid()
        with self.fig.batch_update():
            self.fig.data[0].z = grid
            self.fig.data[0].x = [str(n) for n in res.lengths]
            self.fig.data[0].y = [f"{d:.2f}" for d in res.depths]
            self.fig.data[0].text = [["" if v is None else f"{v:.0%}" for v in row] for row in grid]
            self.fig.layout.title = f"passkey exact match: {res.kv_format} cache, {self.haystack.value} haystack"
        ref = self.result(self.reference)
        parts = []
        for n in res.lengths:
            c, t = counts(res.rows, length=n)
            lo, hi = wilson(c, t)
            ref_txt = f" ({self.reference} {ref.accuracy(n):.0%})" if ref.rows and n in ref.lengths else ""
            parts.append(f"{n} tokens: <b>{c / t:.0%}</b> [{lo:.0%}, {hi:.0%}]{ref_txt}")
        self.status.value = " &nbsp;·&nbsp; ".join(parts)

    def widget(self):
        return w.VBox([w.HBox([self.kv_format, self.haystack]), self.fig, self.status])


class CostQualityTable(_Panel):
    """Chapter 5's decision table: cost per format from the simulator, beside chapter 4's measured quality.

    With ``needle`` (``{format: {model: paired verdict}}``, :func:`kvlab.facts.paired_risk`) each model's paired
    needle verdict is shown, red where the format did not hold. With ``quality`` (per-length scores,
    :func:`kvlab.results.quality_by_length`) a slider sets the minimum passkey exact match a format must reach at
    each context length instead. With ``perplexity`` ({format: relative increase}, or {format: {model: increase}})
    a slider sets the largest perplexity increase allowed.
    """

    def __init__(self, requests, model, gpu, formats, quality: dict | None = None, threshold: float = 0.9,
                 gpu_hour_usd=None, reference: dict | float | None = None, perplexity: dict | None = None,
                 max_ppl_increase: float = PPL_TOLERANCE, needle: dict | None = None):
        from .simulator import cost_table

        if quality is not None and not (isinstance(quality, dict) and all(
                isinstance(v, dict) or isinstance(v, int | float) and not isinstance(v, bool) for v in quality.values())):
            raise TypeError("CostQualityTable: quality must map each format to a score or to {context length: score}")
        if not list(formats):
            raise ValueError("CostQualityTable: formats must name at least one KV format")
        if quality is None and needle is None:
            raise ValueError("give the measured quality: needle= (chapter 4's paired verdicts) or quality= (scores)")
        missing = [f for f in formats if (needle is not None and str(f) not in needle) or (
            quality is not None and all(v is None for v in quality.get(str(f), {}).values()))]
        if missing:
            raise ValueError(f"no measured quality for {missing}; they are not in chapter 4's sweeps")
        _in_range("CostQualityTable", "threshold", threshold, 0, 1)
        _in_range("CostQualityTable", "max_ppl_increase", max_ppl_increase, 0, 0.5)  # the slider's range
        self._rows = lambda t, p: cost_table(requests, model, gpu, formats, quality=quality, threshold=t,
                                             gpu_hour_usd=gpu_hour_usd, reference=reference, perplexity=perplexity,
                                             max_ppl_increase=p, needle=needle)
        self.relative = reference is not None
        style = {"description_width": "initial"}
        self.threshold = w.FloatSlider(value=threshold, min=0.0, max=1.0, step=0.05, style=style,
                                       description="min exact match" + (" (x full precision)" if self.relative else ""))
        self.max_ppl = w.FloatSlider(value=max_ppl_increase, min=0.0, max=0.5, step=0.01, readout_format=".0%",
                                     description="max perplexity increase", style=style)
        self.controls = ([self.threshold] if quality is not None else []) + ([self.max_ppl] if perplexity else [])
        self.table = w.HTML()
        for c in self.controls:
            c.observe(self.update, names="value")
        self.update()

    def update(self, change=None):
        self.rows = self._rows(self.threshold.value, self.max_ppl.value)
        self.table.value = cost_table_html(self.rows)

    def widget(self):
        return w.VBox([*self.controls, self.table])
