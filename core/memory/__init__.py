"""KV memory: the pools, the allocator interface and the radix prefix cache."""
