"""Built-in LoRA backends: the kernels that add adapters' deltas to linear layers (core/lora/backend.py)."""
