"""Built-in treadle plugins, registered through the same entry points as third-party ones."""
