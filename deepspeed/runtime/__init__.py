"""Training runtime: the engine, config parsing, precision, ZeRO and checkpoints."""
