"""Upstream's home of `RepeatingLoader` (`deepspeed.runtime.dataloader.RepeatingLoader`); it lives in
deepspeed/utils/repeating_loader.py, so the utilities need nothing from the runtime."""

from deepspeed.utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader"]
