"""Embedding models: poolings, what a checkpoint says about them, the vectors a request gets back."""
