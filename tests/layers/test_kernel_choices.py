"""layers/kernel_choices.py: a launch choice kept on disk is found again for the same key, candidates and machine,
and only for them; the file survives a bad neighbour (unreadable JSON) and another process's choices; off means
nothing is read or written."""

from __future__ import annotations

import json

import torch

from treadle.layers import kernel_choices

CPU = torch.device("cpu")


def test_a_kept_choice_is_found_for_the_same_key_and_candidates_only(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    monkeypatch.setenv("TREADLE_KERNEL_CHOICES", str(path))
    key, candidates = ("int", 4096, 4096, 16), ["a(split=1)", "b(split=2)", "c(split=4)"]
    assert kernel_choices.cached_choice(key, candidates, CPU) is None
    kernel_choices.store_choice(key, candidates, CPU, 2, 1.5e-5)
    assert kernel_choices.cached_choice(key, candidates, CPU) == (2, 1.5e-5)
    assert kernel_choices.cached_choice(("int", 4096, 4096, 32), candidates, CPU) is None  # another bucket
    assert kernel_choices.cached_choice(key, candidates[:2], CPU) is None  # the candidates changed: time again
    kernel_choices.store_choice(("int", 1, 2, 3), ["x", "y"], CPU, 0, 1e-6)  # another shape, kept beside
    assert kernel_choices.cached_choice(key, candidates, CPU) == (2, 1.5e-5)
    (machine,) = json.loads(path.read_text())["machines"].values()
    assert len(machine["choices"]) == 2 and machine["machine"].startswith("cpu|torch ")


def test_the_most_recently_written_machines_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_KERNEL_CHOICES", str(tmp_path / "choices.json"))
    machines = [f"machine {i}" for i in range(kernel_choices.KEPT_MACHINES + 2)]
    for machine in machines:  # as if the kernels' source changed between starts
        monkeypatch.setattr(kernel_choices, "_machine_key", lambda device, machine=machine: machine)
        kernel_choices.store_choice(("k",), ["a", "b"], CPU, 1, 1e-6)
    kept = json.loads((tmp_path / "choices.json").read_text())["machines"]
    assert sorted(kept) == sorted(machines[2:])
    assert kernel_choices.cached_choice(("k",), ["a", "b"], CPU) == (1, 1e-6)  # the last one's
    monkeypatch.setattr(kernel_choices, "_machine_key", lambda device: machines[0])
    assert kernel_choices.cached_choice(("k",), ["a", "b"], CPU) is None


def test_an_unreadable_file_is_timed_past_and_replaced(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    monkeypatch.setenv("TREADLE_KERNEL_CHOICES", str(path))
    for broken in ("{not json", '{"machines": []}', '{"machines": {"x": 3}}'):
        path.write_text(broken)
        assert kernel_choices.cached_choice(("k",), ["a"], CPU) is None
    kernel_choices.store_choice(("k",), ["a", "b"], CPU, 1, 2e-6)
    assert kernel_choices.cached_choice(("k",), ["a", "b"], CPU) == (1, 2e-6)


def test_off_reads_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_KERNEL_CHOICES", "off")
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path))
    kernel_choices.store_choice(("k",), ["a"], CPU, 0, 1e-6)
    assert kernel_choices.cached_choice(("k",), ["a"], CPU) is None
    assert not list(tmp_path.iterdir())


def test_a_kernel_setting_makes_another_machine(monkeypatch):
    kernel_choices._machine.cache_clear()
    monkeypatch.setenv("TREADLE_PDL", "1")
    with_pdl = kernel_choices._machine_key(CPU)
    kernel_choices._machine.cache_clear()
    monkeypatch.setenv("TREADLE_PDL", "0")
    assert kernel_choices._machine_key(CPU) != with_pdl
    kernel_choices._machine.cache_clear()


def test_the_default_file_is_under_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.delenv("TREADLE_KERNEL_CHOICES")
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path))
    assert kernel_choices.choices_path() == tmp_path / "kernel-choices.json"


def test_the_small_batch_matmuls_choice_is_kept_and_taken_at_the_next_start(tmp_path, monkeypatch):
    from treadle.kernels import small_batch as kernels
    from treadle.layers import small_batch

    monkeypatch.setenv("TREADLE_KERNEL_CHOICES", str(tmp_path / "choices.json"))
    monkeypatch.setattr(small_batch, "weight_copies", lambda weight: [weight])
    monkeypatch.setattr(kernels, "small_batch_matmul", lambda x, weight, scale, config: config)
    timed = []

    def graph_seconds(run):
        timed.append(run(0))
        return {"library": 2e-5, "a": 3e-5, "b": 1e-5}[timed[-1]]

    monkeypatch.setattr(small_batch, "graph_seconds", graph_seconds)
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    ticks = []
    for _ in range(2):
        chosen = small_batch._fastest(weight, None, torch.bfloat16, 16, lambda x, w: "library", ["a", "b"],
                                      lambda: ticks.append(1))
        assert chosen == "b"
    assert timed == ["library", "a", "b"] and len(ticks) == 6  # the second start timed nothing
