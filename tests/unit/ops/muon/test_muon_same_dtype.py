"""Parameter-change checks compare tensors of one dtype, both captured after deepspeed.initialize.

Upstream's Muon tests ran 5 steps and asserted "parameters changed" by comparing fp32 parameters captured
before deepspeed.initialize with the fp16 parameters after it. The cast to fp16 changes almost every
value, so that assertion passes with zero optimizer steps (it passed while the momentum was poisoned and
no step was ever applied). The suite's helper, `moved_parameters`, refuses tensors of different dtypes,
and on snapshots taken after initialize it reports that nothing moved until a step is really applied.
"""

import pytest
import torch

from unit.common import DistributedTest

from muon_suite import (fp32_masters, global_batches, initialize, make_model, model_parameters, moved_parameters,
                        muon_config, train)


def upstream_parameters_changed(before_initialize, engine):
    """Upstream's old check: fp32 tensors from before initialize vs the engine's (fp16) parameters."""
    return [name for name, param in engine.module.named_parameters()
            if not torch.equal(before_initialize[name], param.detach().cpu())]


class TestMovedParametersHelper:

    def test_refuses_tensors_of_different_dtypes(self):
        before = {"w": torch.randn(4, 4)}
        with pytest.raises(TypeError, match="refusing to compare torch.float32 with torch.float16"):
            moved_parameters(before, {"w": before["w"].half()})

    def test_reports_only_real_changes(self):
        before = {"a": torch.randn(4, 4), "b": torch.randn(4)}
        after = {"a": before["a"].clone(), "b": before["b"] + 1e-2}
        assert moved_parameters(before, {k: v.clone() for k, v in before.items()}) == []
        assert moved_parameters(before, after) == ["b"]
        assert moved_parameters(before, after, min_relative_change=10.0) == []

    def test_refuses_non_finite_results(self):
        before = {"a": torch.ones(2)}
        with pytest.raises(ValueError, match="non-finite"):
            moved_parameters(before, {"a": torch.tensor([1.0, float("nan")])})


class TestCastIsNotMovement(DistributedTest):
    world_size = 2

    @pytest.mark.upstream_pr
    @pytest.mark.parametrize("stage", [1, 2])
    def test_old_assertion_passes_for_a_cast_alone(self, stage):
        model = make_model()
        before_initialize = {name: p.detach().clone() for name, p in model.named_parameters()}
        assert all(t.dtype == torch.float32 for t in before_initialize.values())
        engine = initialize(model, muon_config(stage, "fp16"))
        masters_at_start, params_at_start = fp32_masters(engine), model_parameters(engine)

        # Zero optimizer steps: upstream's assertion still says every parameter changed (the cast did it)...
        assert engine.global_steps == 0
        assert sorted(upstream_parameters_changed(before_initialize, engine)) == sorted(before_initialize)
        # ...ours refuses the mixed-dtype comparison and, on same-dtype snapshots, sees nothing move.
        with pytest.raises(TypeError):
            moved_parameters(before_initialize, model_parameters(engine))
        assert moved_parameters(masters_at_start, fp32_masters(engine)) == []
        assert moved_parameters(params_at_start, model_parameters(engine)) == []

        # Skipped steps (the default scale 2**16 overflows SimpleModel-style fp16 losses) move nothing either;
        # the first applied step moves every parameter.
        for batch in global_batches(6, 16):
            train(engine, [batch], "fp16")
            if engine.was_step_applied():
                break
            assert moved_parameters(masters_at_start, fp32_masters(engine)) == []
        assert engine.was_step_applied(), f"no step applied in {engine.global_steps} steps"
        assert engine.skipped_steps >= 1
        assert sorted(moved_parameters(masters_at_start, fp32_masters(engine))) == sorted(before_initialize)
        assert sorted(moved_parameters(params_at_start, model_parameters(engine))) == sorted(before_initialize)
