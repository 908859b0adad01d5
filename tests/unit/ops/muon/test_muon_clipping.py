"""Gradient clipping acts on the gradient, not on the orthogonalised Muon update.

`gradient_clipping` bounds the global L2 norm of the (unscaled) gradient. Upstream clips after Muon, on the
orthogonalised updates, whose norm does not depend on the gradient: about sqrt(min(rows, cols)) per matrix (~8
for TinyMLP's three matrices). So with the default clipping of 1.0 every Muon step is shrunk several times, even
when the gradient is far below the threshold. Here a threshold twice the gradient's norm must change nothing, and
a threshold below it must clip the gradient the Muon momentum folds in: Newton-Schulz does not see a gradient's
scale, so clipping shows only through the momentum, over steps clipped by different factors, against a
single-process reference that clips with torch's clip_grad_norm_.
"""

import pytest
import torch

from unit.common import DistributedTest

from muon_suite import (assert_identical, fp32_masters, global_batches, initialize, make_model, muon_config,
                        reference_muon_update, reference_training, relative_error, train)

GLOBAL_BATCH = 16
# As test_muon_reference_parity: full-rank gradients, 6 steps, the same tolerance on each parameter's change.
PARITY_BATCH, STEPS, LR, ADAM_LR, TOLERANCE = 64, 6, 0.05, 0.01, 1e-3


def gradient_and_update_norms(batch):
    """The global gradient norm of a single-process fp32 step on `batch`, and the norm of its Muon updates."""
    model = make_model()  # the engines' models come from the same seed
    model(*batch).backward()
    grads = [p.grad for p in model.parameters()]
    updates = [reference_muon_update(g, torch.zeros_like(g)) for g in grads if g.ndim >= 2]
    return torch.stack([g.norm() for g in grads]).norm().item(), torch.stack([u.norm() for u in updates]).norm().item()


class TestMuonClipping(DistributedTest):
    reuse_dist_env = True
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

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_clipping_below_the_gradient_norm_clips_what_muon_folds_in(self, stage):
        # Inputs scaled differently step by step, so the gradients' norms differ by up to 25x: clipped to one norm,
        # the momentum weighs the steps quite differently from the unclipped one.
        scales = (1.0, 5.0, 0.2, 3.0, 1.0, 0.5)
        batches = [(x * scale, y) for (x, y), scale in zip(global_batches(STEPS, PARITY_BATCH), scales)]
        model = make_model()
        norms = []
        reference_training(model, batches, lr=LR, adam_lr=ADAM_LR, grad_norms=norms)
        clip = 0.3 * min(norms)
        clipped_norms = []
        expected = reference_training(model, batches, lr=LR, adam_lr=ADAM_LR, clip=clip, grad_norms=clipped_norms)
        unclipped = reference_training(model, batches, lr=LR, adam_lr=ADAM_LR)
        assert min(clipped_norms) > 1.5 * clip, "clipping must be active, by a different factor, at every step"

        engine = initialize(model, muon_config(stage, "fp32", micro=PARITY_BATCH // 2, lr=LR, adam_lr=ADAM_LR,
                                               clip=clip, ns_method="standard"))
        start = fp32_masters(engine)
        seen_norms = []
        for batch in batches:
            train(engine, [batch], "fp32")
            seen_norms.append(engine.get_global_grad_norm())
        assert engine.skipped_steps == 0
        assert seen_norms == pytest.approx(clipped_norms, rel=1e-4)
        got = fp32_masters(engine)
        errors = {name: relative_error(got[name] - start[name], expected[name] - start[name]) for name in start}
        assert max(errors.values()) <= TOLERANCE, f"relative error vs the clipped reference: {errors}"
        # Power: the unclipped run is far outside the tolerance, on the Muon matrices too.
        power = {name: relative_error(unclipped[name] - start[name], expected[name] - start[name])
                 for name in start if got[name].ndim >= 2}
        assert min(power.values()) > 10 * TOLERANCE, f"clipped vs unclipped reference: {power}"
