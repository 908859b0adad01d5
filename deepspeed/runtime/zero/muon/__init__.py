"""Muon: the update math (:mod:`.original_muon`) and the optimizer over whole matrices (:mod:`.muon_optimizer`)."""

from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam, muon_param_groups
from deepspeed.runtime.zero.muon.original_muon import (
    NS_FUNCTIONS,
    adam_update,
    count_newton_schulz_calls,
    momentum_directions,
    muon_update,
    muon_update_batch,
    zeropower_via_gram_newtonschulz,
    zeropower_via_newtonschulz5,
)

__all__ = [
    "NS_FUNCTIONS",
    "MuonWithAuxAdam",
    "adam_update",
    "count_newton_schulz_calls",
    "momentum_directions",
    "muon_param_groups",
    "muon_update",
    "muon_update_batch",
    "zeropower_via_gram_newtonschulz",
    "zeropower_via_newtonschulz5",
]
