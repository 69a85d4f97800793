"""Shared model layers: tensor-parallel linear layers, the Llama-family decoder blocks, MoE, FP8, fused ops.

Model families (``plugins/models/``) are built from these. The names below are the blocks a family
plugin usually needs; ``docs/plugins.md`` shows one built from them.
"""

from treadle.layers.checkpoint import LoadsOwnCheckpoint, checkpoint_targets, load_checkpoint
from treadle.layers.decoder import DecoderLayer, check_activation, head_dim, layer_sliding_window, num_kv_heads
from treadle.layers.linear import (
    CheckpointError,
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from treadle.layers.mlp import GatedMLP
from treadle.layers.norm import RMSNorm
from treadle.layers.rotary import RotaryEmbedding, rope_inv_freq, rope_parameters
from treadle.layers.self_attention import SelfAttention

__all__ = [
    "CheckpointError", "ColumnParallelLinear", "DecoderLayer", "GatedMLP", "LinearBase", "LoadsOwnCheckpoint",
    "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "RotaryEmbedding",
    "RowParallelLinear", "SelfAttention", "VocabParallelEmbedding", "check_activation", "checkpoint_targets",
    "default_weight_loader", "head_dim", "layer_sliding_window", "load_checkpoint", "num_kv_heads",
    "rope_inv_freq", "rope_parameters",
]
