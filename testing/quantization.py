"""Conformance check for ``quantization_methods`` plugins: a method's layers against their dequantized reference.

    from treadle.testing import check_quantization_method

    def test_my_method_conforms():
        check_quantization_method(MyMethod, {"quant_method": "mine", "bits": 4}, my_layer_tensors)

``layer_tensors(weight)`` is the plugin's own writer: it quantizes one ``weight`` [N, K] the way a checkpoint of the
format stores it and returns ``(checkpoint tensors by name, the dequantized weight)``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from treadle.core.loading.quantization_method import QuantizationMethod, QuantizationRequest

LayerTensors = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]

ROWS = (1, 5, 40)


def check_quantization_method(method: type[QuantizationMethod] | QuantizationMethod, quantization_config: dict[str, Any],
                              layer_tensors: LayerTensors, in_features: int = 256, out_features: int = 128,
                              device: str = "cpu", dtype: torch.dtype = torch.float32, tolerance: float = 1e-3) -> None:
    """Build ``method``'s quant config from a checkpoint's ``quantization_config``, then for a column-parallel
    layer, a merged one (two parts, loaded one by one) and a row-parallel one: load tensors written by
    ``layer_tensors`` through the parameters' ``weight_loader``, finish the layer, and assert its output for
    1, 5 and 40 rows equals ``x @ dequantized.T`` within ``tolerance`` (relative)."""
    from treadle.core.loading.lazy_weights import finish_module
    from treadle.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
    from treadle.layers.checkpoint import checkpoint_targets

    instance = method() if isinstance(method, type) else method
    assert isinstance(instance, QuantizationMethod), f"{method!r} is not a QuantizationMethod"
    assert quantization_config.get("quant_method") in instance.checkpoint_methods, (
        f"{type(instance).__name__}.checkpoint_methods {instance.checkpoint_methods} does not list the config's "
        f"quant_method {quantization_config.get('quant_method')!r}")
    quant_config = instance.build(quantization_config, QuantizationRequest(torch.device(device)))
    generator = torch.Generator().manual_seed(0)
    layers = {
        "column": (lambda: ColumnParallelLinear(in_features, out_features, quant_config=quant_config,
                                                prefix="model.layers.0.self_attn.o_proj"), ("proj",)),
        "merged": (lambda: MergedColumnParallelLinear(in_features, {"gate_proj": out_features, "up_proj": out_features},
                                                      quant_config=quant_config,
                                                      prefix="model.layers.0.mlp.gate_up_proj"),
                   ("gate_proj", "up_proj")),
        "row": (lambda: RowParallelLinear(in_features, out_features, quant_config=quant_config,
                                          prefix="model.layers.0.mlp.down_proj"), ("proj",)),
    }
    for kind, (build, parts) in layers.items():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                layer = build()
        finally:
            torch.set_default_dtype(previous)
        references = []
        targets = checkpoint_targets(layer)
        for part in parts:
            weight = torch.randn(out_features, in_features, generator=generator) * 0.05
            stored, dequantized = layer_tensors(weight)
            references.append(dequantized.float())
            for name, tensor in stored.items():
                key = f"{part}.{name}" if kind == "merged" else name
                param, shard_id = targets.get(key, (None, None))
                assert param is not None, f"{kind} layer: no parameter takes the checkpoint tensor '{name}'"
                loader = param.weight_loader
                loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
        finish_module(layer)
        reference = torch.cat(references).to(device)
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=generator).to(device, dtype)
            with torch.inference_mode():
                y = layer(x).float()
            expected = x.float() @ reference.t()
            error = ((y - expected).norm() / expected.norm()).item()
            assert error < tolerance, f"{kind} layer, {rows} rows: relative error {error:.2e} (at most {tolerance})"
