"""Built-in treadle plugins: kv_allocators."""
