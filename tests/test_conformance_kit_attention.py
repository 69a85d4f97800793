"""``treadle.testing.check_attention_backend``: torch_native and triton (interpreted) pass it, broken backends fail it.

The triton run happens in a fresh subprocess with TRITON_INTERPRET=1 set before
anything imports triton (see tests/plugins/test_triton_backend.py for why).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from treadle.core.execution.forward_batch import ForwardBatch
from treadle.plugins.attention.torch_native import TorchNativeAttnBackend
from treadle.testing import check_attention_backend

SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16, max_seq_len=40, batch_size=3, sliding_window=12)

_TRITON_SCRIPT = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from treadle.plugins.attention.triton.backend import TritonAttnBackend
from treadle.testing import check_attention_backend

SMALL = {small}

def small_blocks(backend):
    # Short requests must still cross block and split boundaries.
    backend.max_kv_splits, backend.min_split_tokens, backend.decode_block_n = 4, 8, 16
    backend.extend_block_m = backend.extend_block_n = 16

{body}
print("SCRIPT_DONE")
"""

# The interpreter cannot run bfloat16 tl.dot, so the CPU FP8 check runs a float16 model.
_FP8_KIT_ARGS = "torch.float16, kv_dtype=torch.float8_e4m3fn, kv_scales=(0.5, 2.0)"


def _run_triton_script(body: str) -> str:
    """Run ``body`` after the script's setup in a fresh interpreter-mode process; return its stdout."""
    pytest.importorskip("triton")
    script = _TRITON_SCRIPT.replace("{small}", repr(SMALL)).replace("{body}", body)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SCRIPT_DONE" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def test_torch_native_conforms() -> None:
    check_attention_backend(TorchNativeAttnBackend, **SMALL)


def test_triton_conforms_under_the_interpreter() -> None:
    _run_triton_script("check_attention_backend(TritonAttnBackend, configure=small_blocks, **SMALL)")


def test_triton_reads_an_fp8_kv_cache_with_scales_exactly_like_torch_native_over_16_bits() -> None:
    _run_triton_script(f"check_attention_backend(TritonAttnBackend, 'cpu', {_FP8_KIT_ARGS}, "
                       "configure=small_blocks, **SMALL)")


_IGNORES_KV_SCALE = """
class IgnoresScale(TritonAttnBackend):
    # Writes K/V with the layer's scales, then reads the stored FP8 values without one of them.
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        cache = forward_batch.kv_cache
        if save_kv_cache:
            cache.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        scales = cache.{name}_scales
        kept, scales[layer.layer_id] = scales[layer.layer_id], 1.0
        try:
            return super().forward(q, k, v, layer, forward_batch, save_kv_cache=False)
        finally:
            scales[layer.layer_id] = kept

try:
    check_attention_backend(IgnoresScale, 'cpu', {args}, configure=small_blocks, **SMALL)
except AssertionError as error:
    print("FAILED:", error)
"""


@pytest.mark.parametrize("name", ["k", "v"])
def test_a_backend_ignoring_an_fp8_kv_scale_fails_the_check(name: str) -> None:
    out = _run_triton_script(_IGNORES_KV_SCALE.replace("{name}", name).replace("{args}", _FP8_KIT_ARGS))
    assert "FAILED:" in out and "differs from torch_native" in out and "kv_dtype=torch.float8_e4m3fn" in out, out


def test_fp8_kv_scales_must_be_powers_of_two() -> None:
    with pytest.raises(ValueError, match="powers of two"):
        check_attention_backend(TorchNativeAttnBackend, kv_dtype=torch.float8_e4m3fn, kv_scales=(0.3, 1.0))


class _IgnoresWindow(TorchNativeAttnBackend):
    def forward(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        window, layer.sliding_window_size = layer.sliding_window_size, None
        try:
            return super().forward(q, k, v, layer, forward_batch, save_kv_cache)
        finally:
            layer.sliding_window_size = window


class _WrongScale(TorchNativeAttnBackend):
    def forward(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        return super().forward(q * 1.1, k, v, layer, forward_batch, save_kv_cache)


class _ForgetsToSaveKV(TorchNativeAttnBackend):
    def forward(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        out = super().forward(q, k, v, layer, forward_batch, save_kv_cache)
        forward_batch.kv_cache.k_buffers[layer.layer_id][forward_batch.out_cache_loc] = 0
        return out


class _ReadsWrongLayer(TorchNativeAttnBackend):
    def forward(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        other = type(layer)(layer.num_heads, layer.head_dim, layer.scaling, layer.num_kv_heads, 0,
                            layer.sliding_window_size)
        return super().forward(q, k, v, other, forward_batch, save_kv_cache)


class _PlansVerifyFromHostLengths(TorchNativeAttnBackend):
    # Says it runs verify steps from the device's lengths, yet takes their prefixes from the host's.
    def verifies_by_decode(self, mode, num_tokens: int) -> bool:
        return mode.is_verify()

    def decodes_by_device_lengths(self) -> bool:
        return False  # torch_native's decode reads the host's lengths (and says so)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_verify() and forward_batch.extend_prefix_lens_cpu is None:
            forward_batch.extend_prefix_lens_cpu = [
                int(n) - t for n, t in zip(forward_batch.seq_lens_cpu, forward_batch.extend_seq_lens_cpu)]
        super().init_forward_metadata(forward_batch)


class _PlansDecodeFromHostLengths(TorchNativeAttnBackend):
    # Says it runs decode steps from the device's lengths, yet torch_native's decode buckets them by the host's.
    def decodes_by_device_lengths(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        (_IgnoresWindow, "sliding_window=12"),
        (_WrongScale, "differs from torch_native"),
        (_ForgetsToSaveKV, "did not write"),
        (_ReadsWrongLayer, "did not write"),
        (_PlansVerifyFromHostLengths, "TARGET_VERIFY of 2 tokens per request from the device's lengths"),
        (_PlansDecodeFromHostLengths, "decode from the device's lengths"),
    ],
)
def test_broken_backends_fail_with_the_scenario_named(backend, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_attention_backend(backend, **SMALL)

