"""The "DeepSpeed" logger and rank-aware helpers."""

import logging
import os
import sys

LOG_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"

log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _create_logger(name: str = "DeepSpeed", level: int = logging.WARNING) -> logging.Logger:
    log = logging.getLogger(name)
    log.setLevel(level)
    log.propagate = False
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
    return log


logger = _create_logger()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def log_dist(message: str, ranks=(0, ), level: int = logging.INFO) -> None:
    """Log `message` on the given global ranks (-1 in `ranks` means every rank)."""
    rank = _rank()
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


_logged_once: set[tuple] = set()


def log_dist_once(message: str, ranks=None, level: int = logging.INFO) -> None:
    """`log_dist`, but each (message, ranks, level) is logged once per process; `ranks=None` is log_dist's default."""
    key = (message, None if ranks is None else tuple(ranks), level)
    if key not in _logged_once:
        _logged_once.add(key)
        log_dist(message, ranks=(0, ) if ranks is None else ranks, level=level)


def set_log_level(level_name: str) -> None:
    """Set the DeepSpeed logger level from a config string ("debug" ... "critical")."""
    logger.setLevel(log_levels[level_name.lower()])


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the level of `custom_logger` (default: the DeepSpeed logger) and of its handlers.

    Raises:
        ValueError: `log_level_str` is not one of debug, info, warning, error, critical (any case).
    """
    if log_level_str.lower() not in log_levels:
        raise ValueError(f"log level must be one of {list(log_levels)}, got {log_level_str!r}")
    target = logger if custom_logger is None else custom_logger
    target.setLevel(log_levels[log_level_str.lower()])
    for handler in target.handlers:
        handler.setLevel(log_levels[log_level_str.lower()])
