"""Built-in treadle plugins: quantization_methods."""
