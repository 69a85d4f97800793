"""Built-in treadle plugins: lora_backends."""
