"""Distributed: process groups and the tensor-parallel rank processes."""
