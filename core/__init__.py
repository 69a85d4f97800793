"""treadle's thin core: types, interfaces and the engine loop. Plugins are reached only via the registry."""
