"""Built-in poolings (``last``, ``mean``, ``cls``) for embedding models."""
