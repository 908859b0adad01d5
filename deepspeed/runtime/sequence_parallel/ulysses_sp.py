"""Upstream's Ulysses sequence parallelism for Hugging Face models: not provided; each name fails on use saying so
(deepspeed/not_provided.py)."""

from deepspeed.not_provided import module_getattr

__getattr__ = module_getattr(__name__)
