"""layers/int_kernel_choice.py's timing at load: every candidate launch is counted on the progress bar (those that
fail to run too, which are skipped), the fastest is kept, and at the next start it is taken from the kept choices
without timing (timings faked: the launches run on GPUs only)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from treadle.layers import int_kernel_choice, small_batch


def test_each_timed_candidate_advances_the_progress_and_the_fastest_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_KERNEL_CHOICES", str(tmp_path / "choices.json"))
    monkeypatch.setattr(int_kernel_choice, "_kept_seconds", {})
    seconds = {"slow": 3e-5, "fast": 1e-5}
    timed = []
    copied = []
    monkeypatch.setattr(small_batch, "weight_copies", lambda weight: copied.append(1) or [weight, weight])
    monkeypatch.setattr(small_batch, "l2_prefetch_bytes", lambda weight, limit: None)

    def graph_seconds(run):
        timed.append(run(0))
        return seconds[timed[-1]]

    monkeypatch.setattr(small_batch, "graph_seconds", graph_seconds)
    import treadle.kernels.int_kernel_plan as plan

    def run_tiles(x, weight, scales, zeros, bits, group, tiles, prefetch=None):
        if tiles == "broken":
            raise RuntimeError("does not compile here")
        return tiles

    monkeypatch.setattr(plan, "run_tiles", run_tiles)
    words = torch.zeros(8, 16, dtype=torch.int32)
    layer = SimpleNamespace(weight=SimpleNamespace(data=words, shape=words.shape, device=words.device),
                            weight_scales=SimpleNamespace(data=torch.ones(8, 1)), weight_zeros=None, bits=4,
                            group_size=128, int_out_dtype=torch.float32)
    counted = []
    pick = int_kernel_choice._timed_pick(layer, counted.append)
    assert pick(["slow", "broken", "fast"], 16) == "fast"
    assert counted == [1, 1, 1] and timed == ["slow", "fast"]
    assert int_kernel_choice.kept_seconds()[(8, 128, 16)] == 1e-5
    # The next start (a new pick) takes the kept choice: nothing timed, the bar advanced by the candidates.
    again = int_kernel_choice._timed_pick(layer, counted.append)
    assert again(["slow", "broken", "fast"], 16) == "fast"
    assert timed == ["slow", "fast"] and counted[3:] == [3]
    assert copied == [1]  # no weight copies made for a kept choice
    assert again(["slow", "fast"], 16) == "fast" and timed[2:] == ["slow", "fast"]  # other candidates: timed
