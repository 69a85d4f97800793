"""Built-in treadle plugins: speculators."""
