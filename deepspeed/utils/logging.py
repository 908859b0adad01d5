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


def set_log_level(level_name: str) -> None:
    """Set the DeepSpeed logger level from a config string ("debug" ... "critical")."""
    logger.setLevel(log_levels[level_name.lower()])
