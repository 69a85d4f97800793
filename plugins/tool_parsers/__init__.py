"""Built-in tool-call parsers (the ``tool_parsers`` plugin kind)."""
