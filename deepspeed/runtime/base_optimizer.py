"""`DeepSpeedOptimizer`: upstream's base class of the optimizer wrappers the engine builds, for isinstance checks."""


class DeepSpeedOptimizer:
    """Base of DeepSpeed's optimizer wrappers; `engine.optimizer` (DeepSpeedZeroOptimizer, every stage) is one."""
