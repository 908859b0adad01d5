"""The Muon step does not depend on the loss scale.

Upstream treats the orthogonalised update as a gradient and unscales it: with fp16 the applied step is
divided by the loss scale (static 1024 moves Muon matrices ~1024x less than static 1) and then clipped
by the norm of the orthogonalised updates. Newton-Schulz output does not depend on the gradient's scale, so
the correct update must not either: dynamic, static 1 and static 1024 give the same parameters up to the
fp16 rounding of the gradients. The dynamic run starts at the default 2**16, which overflows on the first
steps; the static runs are fed only the batches whose step the dynamic run applied.
"""

import pytest

from unit.common import DistributedTest

from muon_suite import (fp32_masters, global_batches, initialize, make_model, muon_config, relative_error, train)

STEPS = 12
GLOBAL_BATCH = 16
# Relative error of the parameter change after 12 steps. Between two scales large enough that no fp16
# gradient underflows (1024, and the dynamic 2**15), scaling by a power of two is exact: measured 0 on CPU
# (the bound leaves room for GPU kernels that reduce in fp16). At scale 1 small fp16 gradients underflow into
# subnormals: measured worst 8.5e-3 (fc3.weight). An update divided by the loss scale is off by ~100% (0.97).
TOLERANCE_SCALED = 1e-3
TOLERANCE_UNSCALED = 5e-2


class TestMuonLossScaleIndependence(DistributedTest):
    world_size = 2

    # ZeRO-1/2, where upstream computes Muon inside the gradient reduction. Stage 0 (upstream's FP16_Optimizer,
    # which does not scale the loss in backward) is pinned for this fork in unit/ops/muon/zero/test_muon_zero.py.
    @pytest.mark.upstream_pr
    @pytest.mark.parametrize("stage", [1, 2])
    def test_dynamic_and_static_scales_give_the_same_parameters(self, stage):
        batches = global_batches(STEPS, GLOBAL_BATCH)
        micro = GLOBAL_BATCH // 2

        dynamic = initialize(make_model(), muon_config(stage, "fp16", micro=micro))
        start = fp32_masters(dynamic)
        applied_batches = []
        for batch in batches:
            train(dynamic, [batch], "fp16")
            if dynamic.was_step_applied():
                applied_batches.append(batch)
        assert dynamic.skipped_steps >= 1, "the default scale 2**16 should overflow on the first steps"
        assert len(applied_batches) >= STEPS - 3, f"the dynamic run applied {len(applied_batches)} of {STEPS} steps"
        results = {"dynamic": fp32_masters(dynamic)}

        for scale in (1.0, 1024.0):
            engine = initialize(make_model(), muon_config(stage, "fp16", micro=micro, fp16={"loss_scale": scale}))
            assert fp32_masters(engine).keys() == start.keys()
            train(engine, applied_batches, "fp16")
            assert engine.skipped_steps == 0, f"static scale {scale} overflowed"
            results[f"static {scale:g}"] = fp32_masters(engine)

        for name in start:
            changes = {run: result[name] - start[name] for run, result in results.items()}
            pairs = [("dynamic", "static 1024", TOLERANCE_SCALED), ("static 1", "static 1024", TOLERANCE_UNSCALED),
                     ("static 1", "dynamic", TOLERANCE_UNSCALED)]
            for run, reference, tolerance in pairs:
                error = relative_error(changes[run], changes[reference])
                assert error <= tolerance, f"{name}: {run} vs {reference}: relative error {error:.2e}"
