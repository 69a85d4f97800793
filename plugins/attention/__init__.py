"""Built-in treadle plugins: attention."""
