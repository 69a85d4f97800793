"""Built-in reasoning parsers (the ``reasoning_parsers`` plugin kind)."""
