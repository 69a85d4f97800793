"""Speculative decoding: speculators propose draft tokens, the target verifies them in one forward."""
