"""The suite's plotting style, the helpers every notebook shares, and the figures built here.

Notebooks call ``style()`` once after importing pyplot; ``ResultWriter.save_plot`` adds
the ``footer`` (model and machine, from the run) and writes PNG and SVG. Everything a
figure shows comes from the run's data: no number is typed into a plot.

- ``style()`` / ``STYLE``: rcParams (fonts, grid, spines, colours, 160 dpi);
- ``FAMILY_COLORS``, ``family_of(name)``, ``family_color(name)``: one colour per
  runtime / engine family (qlib fast, qlib faithful forms, transformers, llama.cpp, torch);
- ``FORM_COLORS``: one colour per QMatMul form (notebook 07);
- ``footer(fig, model=..., machine=...)``, ``machine_line(info, device)``;
- ``log2_axis(ax)``: a base-2 axis with plain-number ticks (1, 2, 4, ...);
- ``log_axis(ax)``: a base-10 axis with plain-number ticks (20, 50, 100; 0.001);
- ``bar_labels(ax, bars, fmt)``, ``value_dots(...)``: values written beside the marks;
- the figures of notebooks 01, 06, 07, 08, 09 and 11 (``decode_steps_figure`` ...).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib as mpl
import matplotlib.pyplot as plt
import matplotlib.text
import numpy as np
from cycler import cycler
from matplotlib.colors import LogNorm
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

PNG_DPI = 160  # save_plot's default
FOOTER_GID = "qlib-footer"

# One colour per runtime / engine family (qlib's two engines in two blues).
FAMILY_COLORS = {
    "qlib fast": "#1f5fa8",
    "qlib faithful": "#7fb2e0",
    "transformers": "#e07b28",
    "llama.cpp": "#3a9e4f",
    "torch": "#c0504d",
    "other": "#8c8c8c",
}
FAMILY_LABELS = {
    "qlib fast": "qlib fast engine",
    "qlib faithful": "qlib faithful engine (QMatMul forms)",
    "transformers": "transformers",
    "llama.cpp": "llama.cpp",
    "torch": "torch int8",
    "other": "other",
}
FORM_COLORS = {"quantized": "#1f5fa8", "f32": "#e07b28", "f16": "#3a9e4f"}
CYCLE = ["#1f5fa8", "#e07b28", "#3a9e4f", "#c0504d", "#8064a2", "#8c564b", "#d16ba5", "#7f7f7f"]

STYLE: dict[str, Any] = {
    "figure.dpi": 100,
    "figure.facecolor": "white",
    "savefig.dpi": PNG_DPI,
    "savefig.facecolor": "white",
    "savefig.bbox": "tight",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.alpha": 0.35,
    "grid.linewidth": 0.6,
    "axes.prop_cycle": cycler(color=CYCLE),
    "lines.markersize": 4,
    "image.cmap": "viridis",
    "svg.hashsalt": "qlab",  # the same figure gives the same SVG
}


def style() -> None:
    """Apply the suite's style to every figure made after this call."""
    mpl.rcParams.update(STYLE)


def context():
    """The style for a ``with`` block only."""
    return mpl.rc_context(STYLE)


# -- families and colours ---------------------------------------------------------------
def family_of(name: str, variant: str | None = None) -> str:
    """The engine family of a runtime or source name.

    ``family_of("qlib", "fast")``, ``family_of("qlib fast cpu 2t")``: 'qlib fast';
    ``family_of("qlib cpu quantized")``: 'qlib faithful'; 'transformers f32': 'transformers';
    'llama.cpp cpu': 'llama.cpp'; 'torch quantize_dynamic int8 (x86)': 'torch'.
    """
    words = str(name).lower().split()
    if variant is not None:
        words += str(variant).lower().split()
    head = words[0] if words else ""
    if head == "qlib" or head.startswith("own") or head == "source":
        return "qlib fast" if "fast" in words else "qlib faithful"
    if head.startswith("transformers"):
        return "transformers"
    if head.startswith("llama.cpp") or head.startswith("llama_cpp"):
        return "llama.cpp"
    if head.startswith("torch"):
        return "torch"
    return "other"


def family_color(name: str, variant: str | None = None) -> str:
    return FAMILY_COLORS[family_of(name, variant)]


def family_handles(families: Iterable[str]) -> list[Any]:
    """Legend patches for the families present, in ``FAMILY_COLORS`` order."""
    from matplotlib.patches import Patch

    present = set(families)
    return [
        Patch(color=c, label=FAMILY_LABELS[f]) for f, c in FAMILY_COLORS.items() if f in present
    ]


# -- footer -------------------------------------------------------------------------------
def _clean_cpu(name: object) -> str:
    text = str(name or "unknown CPU")
    for junk in ("(R)", "(TM)", "(tm)", "(r)"):
        text = text.replace(junk, "")
    return " ".join(text.split())


def machine_line(info: Mapping[str, Any], device: object = "cpu") -> str:
    """'<cpu model>, <n> cores · <device>' from ``qlib.suite.machine.machine_info()``.

    The device is 'cpu', or the GPU's name with its device ('NVIDIA H200 (cuda)').
    """
    cores = info.get("logical_cores")
    cpu = _clean_cpu(info.get("cpu")) + (f", {cores} cores" if cores else "")
    dev = str(device or "cpu")
    tag = dev.split(":", 1)[0]
    if tag == "cpu":
        return f"{cpu} · cpu"
    gpus = [g for g in info.get("gpus") or [] if str(g.get("device", "")).startswith(tag)]
    first = f"{tag}:0" if ":" not in dev else dev
    gpu = next((g for g in gpus if g.get("device") == first), gpus[0] if gpus else None)
    name = gpu.get("name") if gpu else None
    return f"{cpu} · {name} ({tag})" if name else f"{cpu} · {tag}"


def model_name(model: object) -> str | None:
    """A model file's name for the footer (a path's last part), or ``model`` as given."""
    if model is None or model == "":
        return None
    text = str(model)
    return Path(text).name if ("/" in text or text.endswith(".gguf")) else text


def footer_text(model: object = None, machine: str | None = None) -> str:
    parts = []
    if model_name(model):
        parts.append(f"model: {model_name(model)}")
    if machine:
        parts.append(f"machine: {machine}")
    return " · ".join(parts)


def _content_bbox(fig, renderer, exclude):
    """The display-space box around everything drawn in ``fig`` except ``exclude``."""
    from matplotlib.transforms import Bbox

    artists = [*fig.axes, *fig.legends, *fig.images]
    artists += [a for a in [*fig.texts, *fig.artists] if a is not exclude]
    boxes = []
    for a in artists:
        if not a.get_visible() or (isinstance(a, mpl.text.Text) and not a.get_text()):
            continue
        bb = a.get_tightbbox(renderer)
        if bb is not None and bb.width and bb.height and np.isfinite(bb.bounds).all():
            boxes.append(bb)
    return Bbox.union(boxes) if boxes else fig.bbox


def _freeze_layout(fig) -> None:
    """Run the figure's layout engine once, then keep what it placed where it placed it.

    ``savefig(bbox_inches="tight")`` re-anchors a legend placed 'outside' by constrained
    layout on the cropped figure's edge (onto the footer); with the layout frozen and such
    legends anchored in figure coordinates, the saved figure is the one the footer measured.
    """
    engine = fig.get_layout_engine()
    if engine is None or type(engine).__name__ == "PlaceHolderLayoutEngine":
        return
    fig.draw_without_rendering()
    r = _renderer(fig)
    for leg in fig.legends:
        if getattr(leg, "_outside_loc", None) is None:
            continue
        box = leg.get_window_extent(r).transformed(fig.transFigure.inverted())
        leg.set_bbox_to_anchor(box, transform=fig.transFigure)
        leg.set_loc("center")
    fig.set_layout_engine("none")


def _renderer(fig):
    get = getattr(fig.canvas, "get_renderer", None)
    return get() if get is not None else fig._get_renderer()


def footer(fig, model: object = None, machine: str | None = None, *, fontsize: float = 7):
    """Write 'model: ... · machine: ...' under everything else in ``fig``; returns the artist.

    The footer is placed when the figure is drawn, centred under the lowest label, legend
    or colour bar, whatever layout the figure has; calling it again replaces the earlier
    footer. Wider than the figure's content, it breaks into two lines (model, machine).
    """
    from matplotlib.font_manager import FontProperties
    from matplotlib.text import Annotation

    for a in [*fig.texts, *fig.artists]:
        if a.get_gid() == FOOTER_GID:
            a.remove()
    text = footer_text(model, machine)
    if not text:
        return None
    _freeze_layout(fig)
    two_lines = text.replace(" · machine: ", "\nmachine: ", 1)
    font = FontProperties(size=fontsize)
    note: list[Annotation] = []

    def under(renderer):
        box = _content_bbox(fig, renderer, note[0])
        width = renderer.get_text_width_height_descent(text, font, ismath=False)[0]
        note[0].set_text(two_lines if width > box.width else text)
        return box

    ann = Annotation(
        text,
        xy=(0.5, 0.0),
        xycoords=under,
        xytext=(0, -4),
        textcoords="offset points",
        ha="center",
        va="top",
        fontproperties=font,
        color="#555555",
        annotation_clip=False,
    )
    ann.set_gid(FOOTER_GID)
    note.append(ann)
    fig.add_artist(ann)
    return ann


# -- axes -----------------------------------------------------------------------------------
def plain(v: float, _pos: object = None) -> str:
    """A tick label as a plain number: 1, 2, 512, 0.05, 1e-06 for the very small."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else ""
    return f"{v:g}"


def log2_axis(ax, axis: str = "x", values: Sequence[float] | None = None) -> None:
    """A base-2 log axis with ticks 1, 2, 4, ... as plain numbers (no 2^k), no minor ticks.

    ``values``: where the ticks go (e.g. the measured sizes); default: the powers of two
    within the axis limits.
    """
    which = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
    ax.autoscale_view()
    if values is None:
        lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
        lo, hi = max(lo, 2.0**-30), max(hi, 2.0**-30)
        values = [2.0**e for e in range(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1)]
    values = sorted({float(v) for v in values if v and v > 0})
    which.set_major_locator(FixedLocator(values))
    which.set_major_formatter(FuncFormatter(plain))
    which.set_minor_locator(NullLocator())
    which.set_minor_formatter(NullFormatter())


def log_axis(ax, axis: str = "y") -> None:
    """A base-10 log axis labelled with plain numbers (no 6x10^2).

    Up to two decades: ticks at 1, 2, 3 and 5 of each decade; up to three: 1, 2, 5; more:
    at the decades only.
    Call it after the data are plotted (it reads the limits).
    """
    which = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    ax.autoscale_view()
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    _plain_log_ticks(which, lo, hi)


def _plain_log_ticks(which, lo: float, hi: float) -> None:
    """Plain-number major ticks on a log axis from ``lo`` to ``hi`` (see ``log_axis``)."""
    decades = math.log10(hi / lo) if lo > 0 and hi > 0 else 99
    subs = (1.0, 2.0, 3.0, 5.0) if decades <= 2 else (1.0, 2.0, 5.0) if decades <= 3 else (1.0,)
    which.set_major_locator(LogLocator(base=10, subs=subs))
    which.set_major_formatter(FuncFormatter(plain))
    which.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    which.set_minor_formatter(NullFormatter())


def bar_labels(ax, bars, fmt: str = "{:.1f}", *, fontsize: float = 7, **kwargs) -> list[Any]:
    """Write each bar's value at its end, formatted with ``fmt`` (a ``str.format`` pattern)."""
    values = [b.get_width() if _horizontal(bars) else b.get_height() for b in bars]
    labels = [fmt.format(v) if np.isfinite(v) else "" for v in values]
    return ax.bar_label(bars, labels=labels, padding=2, fontsize=fontsize, **kwargs)


def _horizontal(bars) -> bool:
    return getattr(bars, "orientation", None) == "horizontal"


def value_dots(
    ax,
    values: Sequence[float],
    *,
    y: Sequence[float] | None = None,
    colors: Sequence[str] | str | None = None,
    fmt: str = "{:.2g}",
    marker: str = "o",
    label: str | None = None,
    size: float = 6,
    **kwargs,
):
    """One marker per row at its value (horizontal), with the value written beside it."""
    y = list(range(len(values))) if y is None else list(y)
    pts = ax.scatter(values, y, c=colors, marker=marker, s=size**2, zorder=3, label=label, **kwargs)
    for v, yy in zip(values, y, strict=True):
        if v is not None and np.isfinite(v):
            ax.annotate(
                fmt.format(v),
                (v, yy),
                xytext=(5, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
    return pts


def legend_above(fig_or_ax, handles=None, labels=None, ncol: int | None = None, **kwargs):
    """A legend above the plotting area (it never covers data)."""
    target = fig_or_ax
    if handles is None:
        axes = target.axes if hasattr(target, "axes") and not hasattr(target, "plot") else [target]
        seen: dict[str, Any] = {}
        for a in axes:
            for h, lab in zip(*a.get_legend_handles_labels(), strict=True):
                seen.setdefault(lab, h)
        labels, handles = list(seen), list(seen.values())
    ncol = ncol or max(1, min(len(handles), 6))
    if hasattr(target, "plot"):  # an Axes
        return target.legend(
            handles,
            labels,
            loc="lower left",
            bbox_to_anchor=(0, 1.02),
            ncol=ncol,
            borderaxespad=0,
            **kwargs,
        )
    return target.legend(handles, labels, loc="outside upper center", ncol=ncol, **kwargs)


# -- notebook 01 ----------------------------------------------------------------------------
def decode_steps_figure(steps_df, devices: Sequence[str]):
    """Every decode step's ms, one line per round, one panel per device on one y axis.

    The y axis is shared (and logarithmic when the steps span more than a factor 5), so the
    panels compare; the legend sits above the panels.
    """
    fig, axes = plt.subplots(
        1,
        len(devices),
        figsize=(5 * len(devices), 3.2),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    d_all = steps_df[steps_df.device.isin(devices)]
    for ax, dev in zip(axes[0], devices, strict=True):
        d = d_all[d_all.device == dev]
        for rnd, g in d.groupby("round"):
            ax.plot(g.step, g.ms, marker="o", label=f"round {rnd}")
        ax.set(xlabel="decode step", title=f"{dev}: each decode step")
        n = int(d_all.step.max()) if len(d_all) else 1
        ax.set_xticks(range(1, n + 1, max(1, n // 10)))
    axes[0][0].set_ylabel("ms per step")
    lo, hi = float(d_all.ms.min()), float(d_all.ms.max())
    if lo > 0 and hi / lo > 5:
        log_axis(axes[0][0], "y")
        axes[0][0].set_ylabel("ms per step (log scale)")
    else:
        axes[0][0].set_ylim(bottom=0)
    legend_above(fig)
    return fig


def phases_figure(rows, parts: Mapping[str, str]):
    """Every phase of every round as bars with their values: totals only, on a linear axis
    (a bar's length is its time; the values are written on top)."""
    fig, ax = plt.subplots(figsize=(9, 3.4), layout="constrained")
    width = 0.8 / max(len(rows), 1)
    for i, (_, r) in enumerate(rows.iterrows()):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(parts))]
        label = f"{r.device} round {r['round']}"
        bars = ax.bar(xs, [r[c] for c in parts.values()], width, label=label)
        bar_labels(ax, bars, "{:.0f}", fontsize=6)
    ax.set_xticks(range(len(parts)), list(parts))
    ax.grid(axis="x", visible=False)
    ax.set(ylabel="ms", title="phases of each round (ms)")
    ax.margins(y=0.12)
    legend_above(fig)
    return fig


# -- notebook 06 ----------------------------------------------------------------------------
def _log_norm(values: Iterable[float]) -> LogNorm:
    """A log colour scale from the decade below the smallest positive value to the largest."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x) and x > 0], float)
    if not len(v):
        return LogNorm(vmin=1e-6, vmax=1.0)
    lo, hi = 10.0 ** math.floor(math.log10(v.min())), float(v.max())
    return LogNorm(vmin=lo, vmax=hi if hi > lo else lo * 10)


def drift_matrix_figure(matrices: Mapping[str, tuple[Any, Any]]):
    """The lower triangle of each drift matrix (max above, mean below), one colour scale.

    ``matrices``: variant -> (max frame, mean frame), square and symmetric with the sources
    as index and columns. Only the pairs below the diagonal are drawn (the rest repeats
    them or is 0); all panels share one logarithmic colour scale from the decade below the
    smallest difference to the largest, with one colour bar; each cell shows its
    value. A pair at exactly 0 is drawn grey.
    """
    all_vals = [
        float(m.to_numpy()[i, j])
        for mats in matrices.values()
        for m in mats
        for i in range(len(m))
        for j in range(i)
    ]
    norm = _log_norm(all_vals)
    cmap = mpl.colormaps["viridis"].with_extremes(bad=(0, 0, 0, 0))
    n_src = max((len(m[0]) for m in matrices.values()), default=2)
    side = max(2.4, 0.75 * (n_src - 1) + 1.4)
    fig, axes = plt.subplots(
        2,
        len(matrices),
        figsize=(side * len(matrices) + 1.4, 2 * side + 0.6),
        squeeze=False,
        layout="constrained",
    )
    im = None
    for col, (t, mats) in enumerate(matrices.items()):
        for row, (m, what) in enumerate(zip(mats, ["max", "mean"], strict=True)):
            ax = axes[row, col]
            ax.grid(False)
            ax.set_title(f"{t}: {what} |logit diff|")
            vals = m.to_numpy(dtype=float)
            n = len(m)
            if n < 2:
                ax.axis("off")
                ax.text(
                    0.5,
                    0.5,
                    "one source: no pair",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                )
                continue
            sub = vals[1:, :-1].copy()  # rows: sources 2..n, columns: sources 1..n-1
            lower = np.tril(np.ones_like(sub, dtype=bool))
            shown = np.ma.masked_where(~lower | (sub <= 0), sub)
            im = ax.imshow(shown, norm=norm, cmap=cmap)
            for i in range(n - 1):
                for j in range(i + 1):
                    v = sub[i, j]
                    if v <= 0:
                        ax.add_patch(
                            mpl.patches.Rectangle(
                                (j - 0.5, i - 0.5), 1, 1, color="#dddddd", zorder=0
                            )
                        )
                        ax.text(j, i, "0", ha="center", va="center", fontsize=7)
                        continue
                    dark = norm(v) < 0.55
                    ax.text(
                        j,
                        i,
                        f"{v:.2g}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if dark else "black",
                    )
            ax.set_xticks(range(n - 1), m.columns[:-1], rotation=40, ha="right", fontsize=7)
            ax.set_yticks(range(n - 1), m.index[1:], fontsize=7)
            for s in ("left", "bottom"):
                ax.spines[s].set_visible(False)
    if im is not None:
        cb = fig.colorbar(im, ax=list(axes.ravel()), shrink=0.6, label="|logit diff| (log)")
        _plain_log_ticks(cb.ax.yaxis, norm.vmin, norm.vmax)
    return fig


def ulp_figure(ulp):
    """Max and mean |logit diff| of each comparison as dots with their values (log axis)."""
    labels = [f"{a}: {b}" for a, b in zip(ulp.variant, ulp.comparison, strict=True)]
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.42 * len(ulp)), layout="constrained")
    y = list(range(len(ulp)))
    value_dots(
        ax,
        list(ulp.max_abs_diff),
        y=y,
        colors=FAMILY_COLORS["qlib fast"],
        label="max",
        marker="D",
        fmt="{:.2g}",
    )
    value_dots(
        ax,
        list(ulp.mean_abs_diff),
        y=y,
        colors=FAMILY_COLORS["qlib faithful"],
        label="mean",
        marker="o",
        fmt="{:.2g}",
    )
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    pos = [v for v in [*ulp.max_abs_diff, *ulp.mean_abs_diff] if v and v > 0]
    if pos:
        ax.set_xlim(min(pos) / 3, max(pos) * 8)  # room for the labels
    log_axis(ax, "x")
    ax.set_xlabel("|logit diff| over the teacher-forced passage (log scale)")
    legend_above(ax)
    return fig


# -- notebook 07 ----------------------------------------------------------------------------
def forms_figure(df, devices: Sequence[str], types: Sequence[str]):
    """ms per call against input rows, a panel per format and device.

    Panels of one device share their y axis; x is base 2 with ticks at the measured row
    counts (1, 2, 4, ...); one legend above.
    """
    fig, axes = plt.subplots(
        len(devices),
        len(types),
        figsize=(3.6 * len(types), 3.0 * len(devices) + 0.4),
        squeeze=False,
        sharex=True,
        sharey="row",
        layout="constrained",
    )
    ms = sorted(df["m"].unique())
    for i, dev in enumerate(devices):
        for j, t in enumerate(types):
            ax = axes[i][j]
            d = df[(df.device == dev) & (df.type == t)]
            forms = set(d.form)
            order = [f for f in FORM_COLORS if f in forms] + sorted(forms - set(FORM_COLORS))
            for form in order:
                g = d[d.form == form]
                ax.plot(g["m"], g["ms"], marker="o", label=form, color=FORM_COLORS.get(form))
            ax.set_title(f"{t} on {dev}")
            if i == len(devices) - 1:
                ax.set_xlabel("input rows m")
        axes[i][0].set_ylabel(f"{dev}: ms per call (log)")
        log_axis(axes[i][0], "y")
    log2_axis(axes[0][0], "x", ms)
    legend_above(fig)
    return fig


# -- notebook 08 ----------------------------------------------------------------------------
def errors_figure(ok, *, max_ref: float, positions: int):
    """Logit error (dots with values, log axis) and argmax agreement (bars with values).

    ``ok``: the error table without the reference row, in display order (top first);
    colours by engine family.
    """
    import pandas as pd

    labels = [
        r.model
        + (f" [{r.form}]" if r.engine == "qlib" else "")
        + (f", {r.bytes / 1e6:.0f} MB" if pd.notna(r.bytes) else "")
        for r in ok.itertuples()
    ]
    colors = [family_color(r.engine, r.form) for r in ok.itertuples()]
    fig, axes = plt.subplots(
        1,
        2,
        figsize=(12, 0.34 * len(ok) + 1.6),
        sharey=True,
        layout="constrained",
        gridspec_kw={"width_ratios": [3, 2]},
    )
    y = list(range(len(ok)))
    err = list(ok["step0_max_diff"])
    value_dots(axes[0], err, y=y, colors=colors, fmt="{:.2g}")
    pos = [v for v in err if v and v > 0]
    if pos:
        axes[0].set_xlim(min(pos) / 3, max(pos) * 10)
    log_axis(axes[0], "x")
    axes[0].set_yticks(y, labels)
    axes[0].invert_yaxis()
    axes[0].grid(axis="y", visible=False)
    axes[0].set_xlabel(
        f"max |logit diff| at the last prompt position (log scale)\n(max |ref| {max_ref:.1f})"
    )
    agree = list(100 * ok["argmax_agree"] / ok["positions"])
    bars = axes[1].barh(y, agree, color=colors)
    bar_labels(axes[1], bars, "{:.0f}%")
    axes[1].set_xlim(0, 112)
    axes[1].set_xticks([0, 25, 50, 75, 100])
    axes[1].grid(axis="y", visible=False)
    axes[1].set_xlabel(f"argmax agreement (%)\nover {positions} teacher-forced positions")
    fams = [family_of(r.engine, r.form) for r in ok.itertuples()]
    fig.legend(handles=family_handles(fams), loc="outside lower center", ncol=4)
    fig.suptitle("error against transformers f32")
    return fig


# -- notebook 09 ----------------------------------------------------------------------------
def _runtime(r: Mapping[str, Any]) -> str:
    return str(r.get("runtime") or r.get("engine") or "")


def speed_label(r: Mapping[str, Any]) -> str:
    """'qlib fast cpu, 2 threads' from a speed row (runtime, variant, device, threads)."""
    name = " ".join(str(x) for x in (_runtime(r), r.get("variant") or "") if x).strip()
    th = r.get("threads")
    if th is None or (isinstance(th, float) and math.isnan(th)):
        return f"{name} {r['device']}"
    n = int(th)
    return f"{name} {r['device']}, {n} thread{'s' if n != 1 else ''}"


def speed_figure(ok, *, prompt_tokens: int, device: str):
    """Prefill and decode time per configuration: bars coloured by engine family, values
    at the bars' ends, configurations grouped by thread count."""
    rows = ok.to_dict("records")
    for r in rows:
        th = r.get("threads")
        r["threads"] = None if th is None or (isinstance(th, float) and math.isnan(th)) else th
    y, pos, last = [], 0.0, object()
    for r in rows:
        th = r["threads"]
        if y and th != last:
            pos += 0.6  # a gap between thread groups
        y.append(pos)
        pos += 1
        last = th
    labels = [speed_label(r) for r in rows]
    colors = [family_color(_runtime(r), r.get("variant")) for r in rows]
    fig, axes = plt.subplots(
        1, 2, figsize=(11, 0.36 * len(rows) + 1.8), sharey=True, layout="constrained"
    )
    for ax, col, xlabel, fmt in (
        (axes[0], "prefill_ms_min", f"prefill of {prompt_tokens} tokens (ms, min)", "{:.0f}"),
        (axes[1], "decode_ms_min", "decode (ms/token, min)", "{:.1f}"),
    ):
        bars = ax.barh(y, [r[col] for r in rows], color=colors)
        bar_labels(ax, bars, fmt)
        ax.set_xlabel(xlabel)
        ax.set_xlim(0, max([r[col] for r in rows] + [0]) * 1.15 or 1)
        ax.grid(axis="y", visible=False)
    axes[0].set_yticks(y, labels)
    axes[0].invert_yaxis()
    fig.legend(
        handles=family_handles(family_of(_runtime(r), r.get("variant")) for r in rows),
        loc="outside lower center",
        ncol=4,
    )
    fig.suptitle(f"speed on {device} (lower is better)")
    return fig


def ladder_figure(rows, *, floor_ms: float):
    """ms/token per rung of the decode ladder (log axis), the bandwidth floor drawn across."""
    rows = [r for r in rows if r.get("ms_per_token") is not None]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.6), layout="constrained")
    y = list(range(len(rows)))
    bars = ax.barh(y, [r["ms_per_token"] for r in rows], color=CYCLE[: len(rows)])
    bar_labels(ax, bars, "{:.3f} ms")
    ax.axvline(floor_ms, color="black", linestyle="--", linewidth=1)
    ax.annotate(f"floor {floor_ms * 1e3:.0f} us", (floor_ms, len(rows) - 0.5), fontsize=8,
                xytext=(4, 0), textcoords="offset points")  # fmt: skip
    log_axis(ax, "x")
    ax.set_yticks(y, [f"{r['rung']}\n{r['kernels_per_token']:.0f} kernels/token" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("decode ms/token (min, log scale; lower is better)")
    ax.grid(axis="y", visible=False)
    ax.set_title("the decode step, from per-op launches to one CUDA graph")
    return fig
