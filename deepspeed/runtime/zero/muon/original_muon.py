"""Upstream's module path for Muon's math (``deepspeed.runtime.zero.muon.original_muon``).

The functions live in ``muon/math/`` (``newton_schulz.py``: the iterations and their dispatch table;
``update.py``: the update rules); their names stay importable from here. ``NS_FUNCTIONS`` is the same dict object,
so wrapping its entries here (``count_newton_schulz_calls``) wraps them everywhere.
"""

from deepspeed.runtime.zero.muon.math.newton_schulz import (  # noqa: F401
    GRAM_RESTART_EVERY_STEP_FROM, GRAM_RESTART_ITERATIONS, NS_FUNCTIONS, NSFunction, check_ns_method,
    count_newton_schulz_calls, gram_restarts_at, zeropower_by_shape, zeropower_via_gram_newtonschulz,
    zeropower_via_newtonschulz5, zeropower_via_symmetric_gram)
from deepspeed.runtime.zero.muon.math.ns_common import NS_COEFFICIENTS, NS_NORM_EPS, resolve_ns_dtype  # noqa: F401
from deepspeed.runtime.zero.muon.math.update import (  # noqa: F401
    ADJUST_LR_FNS, MOMENTUM_DTYPES, adam_update, apply_update, check_adjust_lr_fn, flat_view, fold_and_direction,
    head_rows, momentum_directions, muon_update, muon_update_batch, orthogonalise, stacked_view, update_scale)
