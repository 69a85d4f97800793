"""`treadle bench plot` draws committed result files: bars with ratios, latency distributions, throughput by rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.bench import plot

RESULTS = Path(plot.__file__).parent / "results"
OFFLINE_RANDOM = RESULTS / "offline_random_vs_hf_cpu_20261126_evening.json"
OFFLINE_SHARED = RESULTS / "offline_shared_prefix_vs_hf_cpu_20261126_evening.json"
ONE_BATCH = RESULTS / "one_batch_nvidia-h100-80gb-hbm3_20261126_median_pairs.json"
RATE4 = RESULTS / "serving_rate4_nvidia-h100-80gb-hbm3_20261126_admission_fix.json"
SATURATION = RESULTS / "serving_saturation_nvidia-h100-80gb-hbm3_20261126_admission_fix.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _texts(figure) -> list[str]:
    return [text.get_text() for ax in figure.axes for text in ax.texts]


def test_offline_runs_draw_a_panel_per_workload_with_ratios_to_the_reference(tmp_path):
    runs = [plot.load_run(f"random={OFFLINE_RANDOM}"), plot.load_run(f"shared={OFFLINE_SHARED}")]
    panels = plot.offline_panels(runs, include=[])
    assert list(panels) == ["random, 16 requests", "shared-prefix, 16 requests"]
    figure = plot.draw_bars(plot._pyplot(), panels, "out tok/s", reference="hf")
    assert "  37.1  1.89×" in _texts(figure) and "  41.6  3.22×" in _texts(figure)  # benchmarks.md's figures
    out = tmp_path / "offline.png"
    assert plot.main([f"random={OFFLINE_RANDOM}", f"shared={OFFLINE_SHARED}", "--reference", "hf", "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_one_batch_panels_per_batch_size_keep_only_the_included_systems():
    panels = plot.one_batch_panels([plot.load_run(str(ONE_BATCH))], include=["Engine.generate", "static cache"])
    assert list(panels) == ["batch size 1", "batch size 32"]
    figure = plot.draw_bars(plot._pyplot(), panels, "decode tok/s", reference="static cache")
    assert any(text.endswith("1.57×") for text in _texts(figure))  # treadle bf16 over hf-compiled at bs=1
    assert all(len(bars) == 3 for bars in panels.values())


def test_serving_runs_under_one_label_make_one_throughput_curve(tmp_path):
    runs = [plot.load_run(f"treadle={RATE4}"), plot.load_run(f"treadle={SATURATION}")]
    figure = plot.draw_serving(plot._pyplot(), runs)
    ttft, itl, rate = figure.axes
    assert len(ttft.get_lines()) == 2 and len(itl.get_lines()) == 2  # a distribution per run
    (curve,) = rate.get_lines()
    assert list(curve.get_ydata()) == [r.result["summary"]["output_token_throughput"] for r in runs]
    assert ttft.get_xscale() == "log"  # 28 ms against seconds at saturation
    out = tmp_path / "serving.png"
    assert plot.main([f"treadle={RATE4}", f"treadle={SATURATION}", "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_results_of_different_benchmarks_are_refused_in_one_plot(tmp_path):
    with pytest.raises(SystemExit, match="one kind per plot"):
        plot.main([str(OFFLINE_RANDOM), str(RATE4), "-o", str(tmp_path / "mixed.png")])
