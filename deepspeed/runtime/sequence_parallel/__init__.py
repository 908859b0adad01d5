"""Upstream's sequence parallelism (Ulysses / ALST) is not implemented: this fork is data parallel only. Its module
paths exist so that clients that import them behind a switch (accelerate, for `parallelism_config` with sp_size > 1)
get an error that names the feature instead of a missing module."""
