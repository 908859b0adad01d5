"""The Muon suite's long-run, same-dtype, loss-scale and resume cases (fp16 and bf16) at ZeRO stage 3.

The test bodies are the upstream PR files' (test_muon_long_run.py, ...), which keep to stages 1-2 because
deepspeed 0.19.8 refuses Muon at stage 3 with reduce_scatter. Each class here subclasses one of them and replaces
its test method with one parametrized by stage 3 only, so the parents' stage-1/2 cases are not collected twice.
"""

import pytest

import test_muon_long_run as long_run
import test_muon_loss_scale as loss_scale
import test_muon_resume as resume
import test_muon_same_dtype as same_dtype


class TestMuonLongRunStage3(long_run.TestMuonLongRun):

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    def test_trains_through_overflow(self, dtype):
        super().test_trains_through_overflow(3, dtype)


class TestCastIsNotMovementStage3(same_dtype.TestCastIsNotMovement):

    def test_old_assertion_passes_for_a_cast_alone(self):
        super().test_old_assertion_passes_for_a_cast_alone(3)


class TestMuonLossScaleIndependenceStage3(loss_scale.TestMuonLossScaleIndependence):

    def test_dynamic_and_static_scales_give_the_same_parameters(self):
        super().test_dynamic_and_static_scales_give_the_same_parameters(3)


class TestMuonResumeContinuesStage3(resume.TestMuonResumeContinues):

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    def test_resumed_run_continues(self, dtype, tmpdir):
        super().test_resumed_run_continues(3, dtype, tmpdir)
