"""Loading: model weights, checkpoints, the embedded default model, the hub, quantization configs."""
