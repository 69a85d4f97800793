"""On a GPU, ModelRunner start-up runs one dummy prefill through the real attention backend (so first-use costs such
as FlashInfer's module load land before the first request); here, on the CPU, that prefill is run by hand: it must
touch no KV slot or request row a request can own."""

from __future__ import annotations

from treadle.core.config import load_config
from treadle.core.execution.model_runner import ModelRunner
from treadle.core.registry import build_registry
from treadle.plugins.attention.torch_native import TorchNativeAttnBackend
from treadle.testing.models import make_tiny_llama


def test_the_start_up_prefill_writes_the_padding_slot_only(tmp_path, monkeypatch):
    seen = []
    forward_extend = TorchNativeAttnBackend.forward_extend

    def spy(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        seen.append((layer.layer_id, forward_batch.out_cache_loc.tolist()))
        return forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache)

    monkeypatch.setattr(TorchNativeAttnBackend, "forward_extend", spy)
    registry = build_registry(["treadle.plugins.models.llama", "treadle.plugins.attention.torch_native",
                               "treadle.plugins.kv_allocators.token"], load_entry_points=False)
    overrides = {"model.path": make_tiny_llama(tmp_path / "llama"), "model.device": "cpu",
                 "attention.backend": "torch_native", "cache.max_total_tokens": 256}
    runner = ModelRunner(load_config(overrides=overrides, use_env=False), registry)
    assert seen == []  # the CPU has no first-use costs to move: start-up does not run it
    runner._warm_up_prefill()
    assert [layer for layer, _ in seen] == list(range(runner.num_layers))  # one prefill, every layer
    assert all(slots == [0] * 16 for _, slots in seen)  # slot 0: padding no request owns
    assert runner.allocator.free_slots == runner.allocator.total_slots
    for layer in range(runner.num_layers):
        assert runner.kv_cache.get_key_buffer(layer)[0].abs().sum() > 0  # the warm-up did write
        assert runner.kv_cache.get_key_buffer(layer)[1:].abs().sum() == 0
        assert runner.kv_cache.get_value_buffer(layer)[1:].abs().sum() == 0
    assert not runner.req_to_token_pool.req_to_token.any()
