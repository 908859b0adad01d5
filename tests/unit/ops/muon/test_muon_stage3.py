"""The Muon suite at ZeRO stage 3: long run, same dtype, loss scale, resume (fp16 and bf16), bit-exact resume, an
overflow seen by one rank (fp16 and bf16), fp32 reference parity and clipping; the long run, bit-exact resume and
one-rank overflow also with this fork's Muon options (muon_suite.VARIANTS).

The test bodies are the suite's files' (test_muon_long_run.py, ...): the upstream PR's keep to stages 1-2 because
deepspeed 0.19.8 refuses Muon at stage 3 with reduce_scatter, and the others are parametrized by the stages their
tables were measured at. Each class here subclasses one of them and replaces its test method with one parametrized
by stage 3 only, so the parents' cases are not collected twice.
"""

import pytest

import test_muon_clipping as clipping
from muon_suite import VARIANT_STATE_KEYS, VARIANTS
import test_muon_long_run as long_run
import test_muon_loss_scale as loss_scale
import test_muon_overflow_agreement as overflow_agreement
import test_muon_reference_parity as reference_parity
import test_muon_resume as resume
import test_muon_resume_exact as resume_exact
import test_muon_same_dtype as same_dtype


class TestMuonLongRunStage3(long_run.TestMuonLongRun):
    reuse_dist_env = True

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    def test_trains_through_overflow(self, dtype):
        super().test_trains_through_overflow(3, dtype)

    @pytest.mark.parametrize("variant", sorted(VARIANTS))
    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    def test_variant_trains_through_overflow(self, dtype, variant):
        self._long_run(3, dtype, **VARIANTS[variant])


class TestCastIsNotMovementStage3(same_dtype.TestCastIsNotMovement):
    reuse_dist_env = True

    def test_old_assertion_passes_for_a_cast_alone(self):
        super().test_old_assertion_passes_for_a_cast_alone(3)


class TestMuonLossScaleIndependenceStage3(loss_scale.TestMuonLossScaleIndependence):
    reuse_dist_env = True

    def test_dynamic_and_static_scales_give_the_same_parameters(self):
        super().test_dynamic_and_static_scales_give_the_same_parameters(3)


class TestMuonResumeContinuesStage3(resume.TestMuonResumeContinues):
    reuse_dist_env = True

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    def test_resumed_run_continues(self, dtype, tmpdir):
        super().test_resumed_run_continues(3, dtype, tmpdir)


class TestMuonResumeStage3(resume_exact.TestMuonResume):
    reuse_dist_env = True

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    def test_resumed_run_equals_uninterrupted(self, dtype, tmpdir):
        super().test_resumed_run_equals_uninterrupted(3, dtype, tmpdir)

    @pytest.mark.parametrize("variant", sorted(VARIANTS))
    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    def test_variant_resumed_run_equals_uninterrupted(self, dtype, variant, tmpdir):
        super().test_variant_resumed_run_equals_uninterrupted(3, dtype, variant, tmpdir)


class TestOverflowSeenByOneRankStage3(overflow_agreement.TestOverflowSeenByOneRank):
    reuse_dist_env = True

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    def test_every_rank_skips(self, dtype):
        super().test_every_rank_skips(3, dtype)

    @pytest.mark.parametrize("variant", sorted(VARIANTS))
    def test_every_rank_skips_with_variant(self, variant):
        self._every_rank_skips(3, "bf16", VARIANT_STATE_KEYS[variant], **VARIANTS[variant])


class TestMuonReferenceParityStage3(reference_parity.TestMuonReferenceParity):
    reuse_dist_env = True

    @pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
    def test_optimizer_step_leaves_gradients_alone(self, dtype):
        super().test_optimizer_step_leaves_gradients_alone(dtype, stage=3)

    def test_fp32_update_equals_reference(self):
        super().test_fp32_update_equals_reference(3)


class TestMuonClippingStage3(clipping.TestMuonClipping):
    reuse_dist_env = True

    def test_clipping_above_the_gradient_norm_changes_nothing(self):
        super().test_clipping_above_the_gradient_norm_changes_nothing(3)

    def test_clipping_below_the_gradient_norm_clips_what_muon_folds_in(self):
        super().test_clipping_below_the_gradient_norm_clips_what_muon_folds_in(3)
