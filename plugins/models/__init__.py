"""Built-in treadle plugins: models."""
