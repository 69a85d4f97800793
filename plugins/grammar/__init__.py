"""Built-in grammar backends (``grammar_backends`` plugins): xgrammar and llguidance."""
