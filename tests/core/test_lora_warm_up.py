"""The LoRA warm-up at engine start (issue 50): the engine asks its LoRA backend, once, to warm up its kernels for
every layer and for batches up to its largest step (``largest_step_tokens``), and not at all without a ``lora``
section. What the ``triton`` backend warms is tests/plugins/test_lora_warm.py's."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from batch_log import record_batches
from lora_warm_recorder import RecordingLoRABackend
from treadle import Engine
from treadle.core.execution.worker import largest_step_tokens

PLUGINS = ["lora_warm_recorder", "treadle.plugins.lora_backends.torch"]


def _config(chunk: int | None, running: int, mixed: bool = False, latency: int = 0,
            max_prefill: int = 8192, context: int = 4096) -> SimpleNamespace:
    scheduler = SimpleNamespace(chunked_prefill_size=chunk, max_running_requests=running, enable_mixed_chunk=mixed,
                                latency_chunk_size=latency, max_prefill_tokens=max_prefill)
    return SimpleNamespace(scheduler=scheduler, model=SimpleNamespace(context_length=context))


def test_largest_step_is_a_chunk_a_mixed_step_or_a_decode_step():
    assert largest_step_tokens(_config(2048, 256)) == 2048
    assert largest_step_tokens(_config(2048, 256, mixed=True)) == 2048 + 256  # the decode rows beside a chunk
    assert largest_step_tokens(_config(256, 64, latency=512)) == 1023  # a latency chunk beside up to 511 rows
    assert largest_step_tokens(_config(None, 16, max_prefill=8192, context=32768)) == 32768  # one whole prompt
    assert largest_step_tokens(_config(512, 300)) == 512
    assert largest_step_tokens(_config(512, 300), decode_tokens_per_req=5) == 1500  # verify steps of k + 1 = 5


def test_engine_warms_its_lora_backend_once_at_start(tiny_llama_dir, caplog):
    RecordingLoRABackend.calls.clear()
    base = {"model": {"path": tiny_llama_dir, "device": "cpu"}, "cache": {"max_total_tokens": 512},
            "scheduler": {"chunked_prefill_size": 32, "max_running_requests": 4, "enable_mixed_chunk": True},
            "plugins": PLUGINS}
    with caplog.at_level(logging.INFO, logger="treadle.core.lora.manager"):
        with Engine({**base, "lora": {"backend": "warm_up_recorder", "max_rank": 8}}) as engine:
            lora = engine.scheduler.worker.runner.lora
            layers = len(lora.layers)
            # The steps stay within the bound warmed: chunks of 32 prompt tokens with up to 4 decode rows beside.
            steps = record_batches(engine, lambda batch: sum(entry.extend_len for entry in batch.entries))
            engine.generate(input_ids=[list(range(5 + i, 45 + i)) for i in range(4)],
                            sampling_params={"max_new_tokens": 3, "ignore_eos": True})
            assert 32 < max(steps) <= 32 + 4
            # A warm-up whose scratch tensors do not fit is given up with a warning; the engine serves.
            lora.backend.out_of_memory = True
            lora.warm_up(16)
            assert "LoRA kernel warm-up ran out of device memory (batches of up to 16 tokens)" in caplog.text
            assert len(engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 2})[0].token_ids) == 2
    assert layers == 4 * 2  # qkv, o, gate_up and down of the tiny Llama's two decoder layers
    assert RecordingLoRABackend.calls[0] == (layers, 32 + 4)  # a chunk and the decode rows of a mixed step
    assert "LoRA kernels warmed up (warm_up_recorder backend, batches of 1 to 36 tokens): 1 batches in" in caplog.text
    with Engine(base):  # no lora section: nothing of LoRA is built, nothing warmed
        pass
    assert len(RecordingLoRABackend.calls) == 2  # the start's and the one run by hand above


def test_a_backend_without_the_hook_is_not_warmed():
    """A backend written against the contract before ``warm_up`` (a duck-typed one, without the base class) starts."""
    from treadle.core.lora.manager import LoRAManager

    manager = LoRAManager.__new__(LoRAManager)
    manager.backend = object()
    manager.warm_up(64)  # nothing to call: no error
