"""Built-in treadle plugins: schedulers."""
