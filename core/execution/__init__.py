"""Execution: forward batches, the model runner, CUDA graphs, attention, sampling."""
