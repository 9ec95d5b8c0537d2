"""The suite's plots: PNG + SVG, the model/machine footer, plain-number log ticks, figures."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from qlib.suite import plots  # noqa: E402
from qlib.suite.machine import machine_info  # noqa: E402
from qlib.suite.results import ResultWriter  # noqa: E402


@pytest.fixture(autouse=True)
def _style():
    with plots.context():
        yield
    plt.close("all")


def _footer(fig):
    found = [a for a in [*fig.texts, *fig.artists] if a.get_gid() == plots.FOOTER_GID]
    assert len(found) == 1, found
    fig.canvas.draw()  # the footer picks its line breaks when drawn
    return found[0].get_text()


def test_save_plot_writes_png_and_svg(tmp_path):
    w = ResultWriter(
        "01_demo",
        params=dict(model_path="/m/SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"),
        output_dir=tmp_path,
    )
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([1, 2, 3], [3, 1, 2])
    png = w.save_plot(fig, "line", caption="a line")
    d = tmp_path / "01_demo"
    assert png == d / "line_cpu.png" and png.stat().st_size > 0
    svg = d / "line_cpu.svg"
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))
    dpi = Image.open(png).info["dpi"]
    assert round(dpi[0]) == 160
    meta = json.loads((d / "meta_cpu.json").read_text())
    assert meta["plots"] == [
        {"stem": "line", "png": "line_cpu.png", "svg": "line_cpu.svg", "caption": "a line"}
    ]
    w.save_plot(fig, "line", caption="a line", dpi=200)  # saved again: one footer, one entry
    assert round(Image.open(png).info["dpi"][0]) == 200
    _footer(fig)
    assert len(json.loads((d / "meta_cpu.json").read_text())["plots"]) == 1


def test_footer_names_model_and_machine(tmp_path):
    w = ResultWriter(
        "01_demo",
        params=dict(model_path="/m/SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"),
        output_dir=tmp_path,
    )
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot([0, 1])
    w.save_plot(fig, "line")
    text = _footer(fig)
    info = machine_info()
    assert "model: SmolLM2-135M-Instruct.Q4_1.gguf" in text
    assert "machine: " in text and plots._clean_cpu(info["cpu"]) in text
    assert f"{info['logical_cores']} cores" in text and text.rstrip().endswith("· cpu")
    assert "/m/" not in text  # the file's name, not its folder

    fig, ax = plt.subplots(figsize=(1.5, 1.5))  # narrow: model and machine on two lines
    w.save_plot(fig, "tiny", model="a seeded random 64x64 weight")
    lines = _footer(fig).splitlines()
    assert lines[0] == "model: a seeded random 64x64 weight" and lines[1].startswith("machine: ")

    fig, ax = plt.subplots()
    w.save_plot(fig, "bare", footer=False)
    assert not [a for a in [*fig.texts, *fig.artists] if a.get_gid() == plots.FOOTER_GID]


def test_machine_line_names_the_gpu():
    info = {
        "cpu": "Intel(R) Xeon(R) Platinum 8480+",
        "logical_cores": 16,
        "gpus": [{"device": "cuda:0", "name": "NVIDIA H200"}],
    }
    assert plots.machine_line(info, "cpu") == "Intel Xeon Platinum 8480+, 16 cores · cpu"
    assert plots.machine_line(info, "cuda") == (
        "Intel Xeon Platinum 8480+, 16 cores · NVIDIA H200 (cuda)"
    )
    assert plots.machine_line({"cpu": "x", "logical_cores": 2}, "cuda").endswith("· cuda")


def _labels(ax, axis="x"):
    ax.figure.canvas.draw()
    ticks = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [t.get_text() for t in ticks if t.get_text()]


def test_log2_ticks_are_plain_numbers():
    ms = [1, 2, 4, 8, 16, 64, 256]
    fig, ax = plt.subplots()
    ax.plot(ms, [1, 2, 3, 4, 5, 6, 7])
    plots.log2_axis(ax, "x", ms)
    assert _labels(ax) == ["1", "2", "4", "8", "16", "64", "256"]
    fig, ax = plt.subplots()
    ax.plot([1, 512], [1, 2])
    plots.log2_axis(ax, "x")  # every power of two in the limits
    assert _labels(ax) == [str(2**e) for e in range(10)]
    assert ax.xaxis.get_minorticklocs().size == 0


def test_log10_ticks_are_plain_numbers():
    fig, ax = plt.subplots()
    ax.bar([0, 1, 2], [30, 120, 600])
    plots.log_axis(ax, "y")
    labels = _labels(ax, "y")
    assert labels and all("$" not in t and "times" not in t and "^" not in t for t in labels)
    assert "100" in labels and "200" in labels  # 1-2-3-5 within two decades
    assert (
        plots.plain(1e-6) == "1e-06" and plots.plain(0.05) == "0.05" and plots.plain(512) == "512"
    )


def test_families():
    assert plots.family_of("qlib", "fast") == "qlib fast"
    assert plots.family_of("qlib fast cpu 2t") == "qlib fast"
    assert plots.family_of("qlib", "quantized") == "qlib faithful"
    assert plots.family_of("qlib cpu f32") == "qlib faithful"
    assert plots.family_of("transformers f32") == "transformers"
    assert plots.family_of("llama.cpp cpu") == "llama.cpp"
    assert plots.family_of("torch", "int8 dynamic") == "torch"
    assert len(set(plots.FAMILY_COLORS.values())) == len(plots.FAMILY_COLORS)


def test_speed_figure_colours_by_family_and_labels_values():
    rows = [
        dict(runtime=r, variant=v, device="cpu", threads=t, prefill_ms_min=p, decode_ms_min=d)
        for t in (1, 2)
        for r, v, p, d in [
            ("qlib", "fast", 80.0, 10.0),
            ("qlib", "f32", 490.0, 77.5),
            ("transformers", "f32", 461.0, 74.4),
            ("llama.cpp", "", 742.0, 14.9),
        ]
    ]
    fig = plots.speed_figure(pd.DataFrame(rows), prompt_tokens=203, device="cpu")
    left = fig.axes[0]
    labels = [t.get_text() for t in left.get_yticklabels()]
    assert labels[0] == "qlib fast cpu, 1 thread" and labels[-1] == "llama.cpp cpu, 2 threads"
    colours = {matplotlib.colors.to_hex(b.get_facecolor()) for b in left.patches}
    assert colours == {
        plots.FAMILY_COLORS[f] for f in ("qlib fast", "qlib faithful", "transformers", "llama.cpp")
    }
    values = [t.get_text() for t in left.texts]
    assert values[:2] == ["80", "490"]  # every bar carries its value


def test_drift_matrix_shows_the_lower_triangle_on_one_scale():
    names = ["transformers f32", "qlib cpu quantized", "qlib cpu f32", "llama.cpp cpu"]
    vals = [[0, 1.1, 6e-5, 1.4], [1.1, 0, 1.1, 1.3], [6e-5, 1.1, 0, 1.4], [1.4, 1.3, 1.4, 0]]
    mx = pd.DataFrame(vals, index=names, columns=names)
    mats = {"Q4_1": (mx, mx / 8), "Q8_0": (mx, mx / 9)}
    fig = plots.drift_matrix_figure(mats)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 4
    norms = {(ax.images[0].norm.vmin, ax.images[0].norm.vmax) for ax in panels}
    assert len(norms) == 1  # one colour scale
    ((vmin, vmax),) = norms
    assert vmin <= 6e-5 / 9 and vmax == pytest.approx(1.4)
    for ax in panels:
        assert len(ax.texts) == 6  # 4 sources: 6 pairs, each once
        assert [t.get_text() for t in ax.get_yticklabels()] == names[1:]
    assert sum(1 for ax in fig.axes if not ax.images) == 1  # one colour bar


def test_errors_figure_uses_dots_with_values():
    ok = pd.DataFrame(
        [
            dict(
                model="own Q8_0",
                engine="qlib",
                form="f32",
                bytes=145e6,
                step0_max_diff=0.64,
                argmax_agree=248,
                positions=256,
            ),
            dict(
                model="torch int8",
                engine="torch",
                form="int8",
                bytes=None,
                step0_max_diff=19.0,
                argmax_agree=113,
                positions=256,
            ),
        ]
    )
    fig = plots.errors_figure(ok, max_ref=29.7, positions=256)
    ax = fig.axes[0]
    assert not ax.patches and ax.collections  # markers, no bars on the log axis
    assert [t.get_text() for t in ax.texts] == ["0.64", "19"]
    assert ax.get_xscale() == "log"


def test_decode_steps_share_one_y_scale():
    steps = pd.DataFrame(
        [
            dict(device=d, round=r, step=s, ms=(400 if (d, r, s) == ("cuda", 1, 1) else m))
            for d, m in (("cpu", 80.0), ("cuda", 28.0))
            for r in (1, 2)
            for s in range(1, 6)
        ]
    )
    fig = plots.decode_steps_figure(steps, ["cpu", "cuda"])
    a, b = fig.axes[:2]
    assert a.get_yscale() == b.get_yscale() == "log" and a.get_ylim() == b.get_ylim()
    assert fig.legends and not a.get_legend()  # the legend sits above the panels
