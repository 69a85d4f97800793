"""Execution: the model worker, forward batches, the model runner, CUDA graphs, attention, sampling."""
