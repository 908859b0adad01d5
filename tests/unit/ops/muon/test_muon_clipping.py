"""Gradient clipping acts on the gradient, not on the orthogonalised Muon update.

`gradient_clipping` bounds the global L2 norm of the (unscaled) gradient. Upstream clips after Muon, on the
orthogonalised updates, whose norm does not depend on the gradient: about sqrt(min(rows, cols)) per matrix (~8
for TinyMLP's three matrices). So with the default clipping of 1.0 every Muon step is shrunk several times, even
when the gradient is far below the threshold. Here a threshold twice the gradient's norm must change nothing.
"""

import pytest
import torch

from unit.common import DistributedTest

from muon_suite import (assert_identical, fp32_masters, global_batches, initialize, make_model, muon_config,
                        reference_muon_update, train)

GLOBAL_BATCH = 16


def gradient_and_update_norms(batch):
    """The global gradient norm of a single-process fp32 step on `batch`, and the norm of its Muon updates."""
    model = make_model()  # the engines' models come from the same seed
    model(*batch).backward()
    grads = [p.grad for p in model.parameters()]
    updates = [reference_muon_update(g, torch.zeros_like(g)) for g in grads if g.ndim >= 2]
    return torch.stack([g.norm() for g in grads]).norm().item(), torch.stack([u.norm() for u in updates]).norm().item()


class TestMuonClipping(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_clipping_above_the_gradient_norm_changes_nothing(self, stage):
        batch = global_batches(1, GLOBAL_BATCH)[0]
        grad_norm, update_norm = gradient_and_update_norms(batch)
        clip = 2 * grad_norm
        # The test has power only where clipping the orthogonalised updates would shrink them.
        assert update_norm > 2 * clip, f"gradient norm {grad_norm:.3f}, update norm {update_norm:.3f}"

        results = {}
        for threshold in (0.0, clip):
            engine = initialize(make_model(), muon_config(stage, "fp32", micro=GLOBAL_BATCH // 2, clip=threshold))
            train(engine, [batch], "fp32")
            assert engine.was_step_applied()
            results[threshold] = fp32_masters(engine)
        assert_identical(results[clip], results[0.0], f"parameters with clipping at {clip:.3f} vs without")
