"""Interactive panels for the notebooks: ipywidgets controls driving plotly FigureWidgets.

Figures are updated in place (``fig.data[i].x = ...`` inside ``batch_update``),
never re-rendered, so moving a slider only sends the changed arrays to the
browser.
"""

from __future__ import annotations

import ipywidgets as w
import plotly.graph_objects as go

from . import budget as B
from .formats import get_format

GiB = 1024**3
CONTEXTS = [2**k for k in range(9, 21)]  # 512 .. 1M tokens
DEFAULT_FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "kivi-2")


def memory_breakdown(model, gpu, kv_format, weights_dtype, batch, context, tp=1, memory_utilization=0.9):
    """GiB per GPU of weights, cache and what is left, plus whether it all fits."""
    f = B.fit(model, gpu, weights_dtype, tp=tp, memory_utilization=memory_utilization)
    cache = B.budget(model, batch, context, kv_format, tp=tp).cache_bytes_per_gpu
    total = B.get_gpu(gpu).memory_bytes
    return {
        "weights": f.weights_bytes_per_gpu / GiB,
        "cache": cache / GiB,
        "free": max(0, total - f.weights_bytes_per_gpu - cache) / GiB,
        "capacity": total / GiB,
        "usable": f.usable_bytes_per_gpu / GiB,
        "fits": f.weights_fit and cache <= f.free_for_cache_per_gpu,
    }


def concurrency_curves(model, gpu, weights_dtype, formats=DEFAULT_FORMATS, contexts=CONTEXTS, tp=1):
    """``{format: [max concurrent sequences at each context]}``."""
    return {
        f: [B.max_concurrency(model, t, f, gpu, weights_dtype, tp=tp) for t in contexts] for f in formats
    }


class BudgetExplorer:
    """Sliders for batch and context, dropdowns for model, GPU, KV format, weights dtype and TP."""

    def __init__(self, model="llama-3.1-70b", gpu="H200", kv_format="bf16", weights_dtype="fp8",
                 batch=16, context=32768, tp=1, formats=DEFAULT_FORMATS):
        self.formats = tuple(formats)
        style = {"description_width": "110px"}
        self.batch = w.IntSlider(value=batch, min=1, max=256, description="batch", style=style,
                                 continuous_update=False)
        self.context = w.FloatLogSlider(value=context, base=2, min=9, max=20, step=0.5,
                                        description="context", style=style, continuous_update=False,
                                        readout_format=".0f")
        self.model = w.Dropdown(options=B.preset_names(), value=model, description="model", style=style)
        self.gpu = w.Dropdown(options=list(B.gpus()), value=gpu, description="GPU", style=style)
        self.kv_format = w.Dropdown(options=list(self.formats), value=get_format(kv_format).name,
                                    description="KV format", style=style)
        self.weights_dtype = w.Dropdown(options=["bf16", "fp8", "int4"], value=weights_dtype,
                                        description="weights", style=style)
        self.tp = w.Dropdown(options=[1, 2, 4, 8], value=tp, description="TP ranks", style=style)
        self.status = w.HTML()

        self.bar = go.FigureWidget(
            data=[go.Bar(name=n, x=[0], y=["per GPU"], orientation="h", marker_color=c)
                  for n, c in (("weights", "#636efa"), ("KV cache", "#ef553b"), ("free", "#c8d6c8"))],
            layout=dict(barmode="stack", height=220, title="Memory per GPU (GiB)",
                        xaxis_title="GiB", margin=dict(l=60, r=20, t=40, b=40)),
        )
        self.curve = go.FigureWidget(
            data=[go.Scatter(name=f, x=CONTEXTS, y=[0] * len(CONTEXTS), mode="lines+markers")
                  for f in self.formats]
            + [go.Scatter(name="you are here", x=[context], y=[batch], mode="markers",
                          marker=dict(size=14, symbol="x", color="black"))],
            layout=dict(height=380, title="Most concurrent sequences that fit, by KV format",
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
            for trace, key in zip(self.bar.data, ("weights", "cache", "free")):
                trace.x = [m[key]]
            self.bar.layout.xaxis.range = [0, max(m["capacity"], m["weights"] + m["cache"]) * 1.02]
        key = (a["model"], a["gpu"], a["weights_dtype"], a["tp"])
        with self.curve.batch_update():
            if key != self._curve_key:  # the curves depend on these only, not on batch or context
                for trace, ys in zip(self.curve.data, concurrency_curves(
                        a["model"], a["gpu"], a["weights_dtype"], self.formats, tp=a["tp"]).values()):
                    trace.y = [max(y, 0.5) for y in ys]  # log axis: show 0 as 0.5
                self._curve_key = key
            self.curve.data[-1].x, self.curve.data[-1].y = [a["context"]], [a["batch"]]
        verdict = "fits" if m["fits"] else "does <b>not</b> fit"
        self.status.value = (
            f"{a['batch']} x {a['context']:,} tokens in {a['kv_format']}: cache {m['cache']:,.1f} GiB per GPU, "
            f"weights {m['weights']:,.1f} GiB, usable {m['usable']:,.1f} GiB &rarr; {verdict}."
        )

    def widget(self):
        controls = w.VBox([self.batch, self.context, self.model, self.gpu, self.kv_format,
                           self.weights_dtype, self.tp])
        return w.VBox([w.HBox([controls, self.bar]), self.status, self.curve])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget())
