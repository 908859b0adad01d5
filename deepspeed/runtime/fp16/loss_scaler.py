"""Loss scalers: pure state machines that decide the fp16 loss scale from overflow reports.

The scalers know nothing of collectives or gradients. The caller detects overflow (agreed across ranks) and
reports it once per optimizer boundary through ``update_scale``. Checkpoints store ``state_dict()``, a dict of
plain numbers, instead of the pickled scaler object that upstream stores.
"""

import logging
import math
import numbers
import os
from typing import Any

import torch

# The same logger object as deepspeed.utils.logger (upstream's name); looked up by name so this module does not
# depend on the utils package.
logger = logging.getLogger("DeepSpeed")

MIN_SCALE_ERROR = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."

STATIC = "static"
DYNAMIC = "dynamic"

# Keys of DynamicLossScaler's constructor that CreateLossScaler accepts in ``dynamic_loss_args``.
DYNAMIC_LOSS_ARG_KEYS = ("init_scale", "scale_window", "delayed_shift", "consecutive_hysteresis", "min_scale")


def _rank() -> int:
    """Return this process's global rank from the launcher's environment (0 when not launched)."""
    # Read from the environment rather than torch.distributed: the scaler must stay free of collectives.
    return int(os.environ.get("RANK", "0"))


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class LossScalerBase:
    """Common surface of the static and dynamic loss scalers.

    Args:
        cur_scale: the initial loss scale.
    """

    def __init__(self, cur_scale: float) -> None:
        self.cur_scale = cur_scale
        self.dynamic = False

    @property
    def loss_scale(self) -> float:
        """The scale that the next backward multiplies the loss by."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * loss_scale``.

        Args:
            loss: the unscaled loss.
        """
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Run backward on the scaled loss.

        Args:
            loss: the unscaled loss.
            retain_graph: passed to ``torch.Tensor.backward``.
        """
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def update_scale(self, overflow: bool) -> None:
        """Record the outcome of one optimizer boundary; the static scaler ignores it.

        Args:
            overflow: whether any rank saw a non-finite gradient at this boundary.
        """

    def state_dict(self) -> dict[str, Any]:
        """Return the scaler's state as plain data (str keys; int, float, bool or str values)."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by ``state_dict``.

        Args:
            state_dict: a dict produced by ``state_dict`` of the same scaler type.

        Raises:
            ValueError: if the dict is of the other scaler type, misses keys, has unexpected keys, or holds a
                value of the wrong type.
        """
        raise NotImplementedError

    def _check_state_dict(self, state_dict: dict[str, Any], expected_type: str, fields: dict[str, str]) -> None:
        """Validate ``state_dict`` against ``fields`` (name -> "number", "int" or "bool") before any mutation.

        Raises:
            ValueError: naming the missing, unexpected or mistyped keys, or the mismatched scaler type.
        """
        name = type(self).__name__
        if not isinstance(state_dict, dict):
            raise ValueError(f"{name}.load_state_dict expects a dict, got {type(state_dict).__name__}")
        found_type = state_dict.get("type")
        if found_type != expected_type:
            raise ValueError(
                f"{name}.load_state_dict expects a state of type {expected_type!r}, got type {found_type!r}; "
                "resume with the loss scaling the checkpoint was saved with (fp16.loss_scale 0: dynamic, > 0: static)"
            )
        expected = set(fields) | {"type"}
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(f"{name}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        checks = {"number": _is_number, "int": _is_int, "bool": lambda v: isinstance(v, bool)}
        mistyped = [key for key, kind in fields.items() if not checks[kind](state_dict[key])]
        if mistyped:
            details = ", ".join(f"{key}={state_dict[key]!r} (expected {fields[key]})" for key in mistyped)
            raise ValueError(f"{name}.load_state_dict: wrong value types: {details}")


class LossScaler(LossScalerBase):
    """A static loss scaler: the scale never changes, overflow or not.

    Args:
        scale: the fixed loss scale.

    Raises:
        ValueError: if ``scale`` is not a finite number > 0.
    """

    _FIELDS = {"cur_scale": "number"}

    def __init__(self, scale: float = 1) -> None:
        if not _is_number(scale) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"static loss scale must be a finite number > 0, got {scale!r}")
        super().__init__(scale)

    def state_dict(self) -> dict[str, Any]:
        """Return ``{'type': 'static', 'cur_scale': scale}``."""
        return {"type": STATIC, "cur_scale": self.cur_scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale saved by ``state_dict``.

        Args:
            state_dict: ``{'type': 'static', 'cur_scale': scale}``.

        Raises:
            ValueError: if the dict is not a static scaler state (naming missing or unexpected keys).
        """
        self._check_state_dict(state_dict, STATIC, self._FIELDS)
        self.cur_scale = state_dict["cur_scale"]


class DynamicLossScaler(LossScalerBase):
    """Upstream's dynamic loss scaler with hysteresis (ZeRO stages 1-3).

    On overflow the scale is divided by ``scale_factor`` (not below ``min_scale``) once ``cur_hysteresis``
    overflows have been absorbed; after ``scale_window`` consecutive good boundaries it is multiplied by
    ``scale_factor`` (no upper cap) and the hysteresis is refilled.

    ``update_scale`` may raise the scale on a good step. The step that reported it must unscale its gradients
    with the scale its backward used, so the caller reads ``loss_scale`` *before* calling ``update_scale``
    (upstream divides by the post-update scale, its Appendix A item 7 defect).

    Args:
        init_scale: the initial scale.
        scale_factor: the factor the scale is divided or multiplied by.
        scale_window: good boundaries since the last overflow (or the start) between scale increases.
        min_scale: the floor of the scale.
        delayed_shift: hysteresis; after each refill the first ``delayed_shift - 1`` overflows keep the scale.
        consecutive_hysteresis: refill the hysteresis on every good boundary instead of only when the scale rises.
        raise_error_at_min_scale: raise when an overflow arrives with the scale already at ``min_scale``.
        dtype: the low-precision dtype; the scale values are logged only for ``torch.half``.

    Raises:
        ValueError: if a scale is not a number > 0, ``scale_factor`` <= 1, or ``scale_window`` /
            ``delayed_shift`` is not an integer >= 1.
    """

    _FIELDS = {
        "cur_scale": "number",
        "cur_iter": "int",
        "last_overflow_iter": "int",
        "scale_factor": "number",
        "scale_window": "int",
        "min_scale": "number",
        "delayed_shift": "int",
        "cur_hysteresis": "int",
        "consecutive_hysteresis": "bool",
        "raise_error_at_min_scale": "bool",
    }

    def __init__(
        self,
        init_scale: float = 2**32,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
        dtype: torch.dtype = torch.half,
    ) -> None:
        for key, value in (("init_scale", init_scale), ("min_scale", min_scale)):
            if not _is_number(value) or not value > 0:
                raise ValueError(f"DynamicLossScaler {key} must be a number > 0, got {value!r}")
        if not _is_number(scale_factor) or not scale_factor > 1:
            raise ValueError(f"DynamicLossScaler scale_factor must be a number > 1, got {scale_factor!r}")
        for key, value in (("scale_window", scale_window), ("delayed_shift", delayed_shift)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"DynamicLossScaler {key} must be an integer >= 1, got {value!r}")
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dtype = dtype
        self.dynamic = True

    def update_scale(self, overflow: bool) -> None:
        """Advance the state machine by one optimizer boundary.

        Call it exactly once per boundary with the overflow flag agreed by all ranks, after reading the scale
        that this boundary's backward used (see the class docstring).

        Args:
            overflow: whether any rank saw a non-finite gradient at this boundary.

        Raises:
            Exception: "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run." when
                an overflow must lower the scale but it is already ``min_scale`` (and
                ``raise_error_at_min_scale``). The plain ``Exception`` type is upstream's surface.
        """
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            self._on_good_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise Exception(MIN_SCALE_ERROR)
            next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            self._log_overflow(f" Attempted loss scale: {int(self.cur_scale)}, reducing to {int(next_scale)}")
            self.cur_scale = next_scale
        else:
            self._log_overflow(
                f" Attempted loss scale: {int(self.cur_scale)}, but hysteresis is "
                f"{self.cur_hysteresis}. Reducing hysteresis to {self.cur_hysteresis - 1}"
            )
            self.cur_hysteresis -= 1

    def _on_good_step(self) -> None:
        if self.consecutive_hysteresis:
            if _rank() == 0:
                logger.info(f"Consecutive hysteresis is enabled. Restoring hysteresis to {self.delayed_shift}")
            self.cur_hysteresis = self.delayed_shift
        stable_iters = self.cur_iter - self.last_overflow_iter - 1
        if stable_iters > 0 and stable_iters % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor

    def _log_overflow(self, fp16_suffix: str) -> None:
        # Only rank 0 logs: the overflow flag is agreed across ranks, so every rank would print the same line.
        rank = _rank()
        if rank != 0:
            return
        message = f"[deepspeed] OVERFLOW! Rank {rank} Skipping step."
        # Upstream reports the scale values only for fp16; under bf16 the scale carries no information.
        if self.dtype == torch.half:
            message += fp16_suffix
        logger.info(message)

    def state_dict(self) -> dict[str, Any]:
        """Return the full state machine as plain data, with ``'type': 'dynamic'``.

        The configuration fields (window, factor, minimum, hysteresis settings) are included because upstream's
        checkpoint restores the whole scaler object, configuration included. ``dtype`` only shapes log lines and
        stays a constructor argument.
        """
        state: dict[str, Any] = {"type": DYNAMIC}
        state.update({key: getattr(self, key) for key in self._FIELDS})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every field saved by ``state_dict``; continuing afterwards equals never having stopped.

        Args:
            state_dict: a dict produced by ``DynamicLossScaler.state_dict``.

        Raises:
            ValueError: if the dict is a static scaler state, misses keys, has unexpected keys, or holds a value of
                the wrong type (the message names them). Nothing is changed then.
        """
        self._check_state_dict(state_dict, DYNAMIC, self._FIELDS)
        for key in self._FIELDS:
            setattr(self, key, state_dict[key])


def CreateLossScaler(  # noqa: N802 (upstream name)
    dtype: torch.dtype, static_loss_scale: float, dynamic_scaling: bool, dynamic_loss_args: dict[str, Any] | None
) -> LossScalerBase:
    """Build the loss scaler of a ZeRO optimizer.

    Scaling only applies to fp16: fp16 with ``dynamic_scaling`` gets a ``DynamicLossScaler`` built from
    ``dynamic_loss_args``; fp16 without gets ``LossScaler(static_loss_scale)``; other dtypes get
    ``LossScaler(1.0)`` whatever was asked.

    Args:
        dtype: the model's low-precision dtype.
        static_loss_scale: the fp16 static scale (config ``fp16.loss_scale``), used when not dynamic.
        dynamic_scaling: whether fp16 scaling is dynamic (config ``fp16.loss_scale == 0``).
        dynamic_loss_args: DynamicLossScaler arguments with keys among ``init_scale``, ``scale_window``,
            ``delayed_shift``, ``consecutive_hysteresis``, ``min_scale``.

    Raises:
        AssertionError: "Dynamic loss scaling parameters must be defined." if fp16 dynamic scaling is asked
            without ``dynamic_loss_args`` (upstream's type and text).
        ValueError: if ``dynamic_loss_args`` has keys other than the ones above, or a value is out of range.
    """
    if dtype == torch.half and dynamic_scaling:
        # A raise rather than an assert so the check survives ``python -O``; the type is upstream's.
        if dynamic_loss_args is None:
            raise AssertionError("Dynamic loss scaling parameters must be defined.")
        unexpected = sorted(set(dynamic_loss_args) - set(DYNAMIC_LOSS_ARG_KEYS))
        if unexpected:
            raise ValueError(
                f"dynamic_loss_args has unexpected keys {unexpected}; allowed keys are {list(DYNAMIC_LOSS_ARG_KEYS)}"
            )
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)
