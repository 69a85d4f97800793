"""The shared linear layers keep ``nn.Linear``'s public attributes: ``in_features`` / ``out_features`` of the whole
layer (on every tensor-parallel rank), and ``weight`` / ``bias`` as the layer's parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from treadle.layers import linear
from treadle.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
)


def _layers() -> dict[str, nn.Module]:
    """Each kind of layer with 64 inputs and, as nn.Linear would see it, the outputs in the key's comment."""
    return {
        "column": ColumnParallelLinear(64, 96, bias=True),  # 96 outputs
        "merged": MergedColumnParallelLinear(64, {"gate_proj": 128, "up_proj": 128}),  # 256
        "qkv": QKVParallelLinear(64, 16, 4, 2, bias=True),  # 4 query + 2 + 2 KV heads of 16: 128
        "row": RowParallelLinear(64, 48),  # 48
        "lm_head": ParallelLMHead(512, 64),  # 512
    }


FULL_OUT = {"column": 96, "merged": 256, "qkv": 128, "row": 48, "lm_head": 512}


def test_they_report_what_nn_linear_reports():
    for name, layer in _layers().items():
        reference = nn.Linear(64, FULL_OUT[name], bias=name in ("column", "qkv"))
        assert (layer.in_features, layer.out_features) == (reference.in_features, reference.out_features), name
        assert layer.weight.shape == reference.weight.shape and isinstance(layer.weight, nn.Parameter), name
        if reference.bias is None:
            assert layer.bias is None, name
        else:
            assert layer.bias.shape == reference.bias.shape and isinstance(layer.bias, nn.Parameter), name


def test_every_rank_reports_the_whole_layer(monkeypatch):
    monkeypatch.setattr(linear, "get_tp_size", lambda: 2)
    monkeypatch.setattr(linear, "get_tp_rank", lambda: 1)
    layers = _layers()
    for name in ("column", "merged", "qkv", "row"):
        assert (layers[name].in_features, layers[name].out_features) == (64, FULL_OUT[name]), name
    # ...while each holds its half: output rows split by the column-parallel layers, input columns by the row one.
    assert layers["column"].weight.shape == (48, 64) and layers["row"].weight.shape == (48, 32)
    assert layers["merged"].weight.shape == (128, 64)


@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_rebuilt_from_them_has_the_same_shape(bias):
    old = RowParallelLinear(64, 48, bias=bias)
    rebuilt = RowParallelLinear(old.in_features, old.out_features, bias=old.bias is not None)
    assert rebuilt.weight.shape == old.weight.shape and (rebuilt.bias is None) == (not bias)
    with torch.no_grad():  # the layers are built empty: the loader fills them
        for name, param in old.named_parameters():
            param.normal_()
            rebuilt.get_parameter(name).copy_(param)
    x = torch.randn(3, 64)
    torch.testing.assert_close(rebuilt(x), old(x))
