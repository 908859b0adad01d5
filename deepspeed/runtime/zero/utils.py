"""ZeRO exceptions."""


class ZeRORuntimeException(Exception):
    """Raised for ZeRO state that cannot be used as requested (e.g. a checkpoint of another world size)."""
