"""Config keys this fork accepts from upstream configs without acting on them: none is ignored silently.

Each is named when a config sets it to anything but its default. A key whose value would change what training
computes (the dtype of the masters, gradients, optimizer states or module buffers, where the gradient division
happens) is refused, naming the key, the value and what this fork does instead. A key that only tunes how upstream
schedules its work, or turns on upstream's logging, is accepted with a warning saying so.

The same holds for upstream's top-level sections of features this fork does not implement: one that turns on a
feature changing what training computes (mixed precision by autocast, model parallelism, data or layer dropping,
compression) is refused; one of logging, monitoring or tooling is accepted with a warning.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from deepspeed.runtime.config_utils import DeepSpeedConfigError, logger

_SUMMED_THEN_DIVIDED = ("gradients are summed across ranks in the communication dtype, then divided once by the "
                        "data-parallel world size when gradient_allreduce_op is mean")
_FP32_MASTERS = "the masters are fp32 and the gradients are kept in data_types.grad_accum_dtype"

# Dotted key (as written in the JSON config) -> what this fork does instead.
REFUSED = {
    "prescale_gradients": _SUMMED_THEN_DIVIDED,
    "gradient_predivide_factor": _SUMMED_THEN_DIVIDED,
    "fp16.fp16_master_weights_and_grads": _FP32_MASTERS,
    "bf16.bf16_master_weights_and_grads": _FP32_MASTERS,
    "bf16.bf16_optimizer_states": "optimizer states are fp32",
    "data_types.buffer_dtype": "module buffers keep the dtype the model gives them",
}

NO_EFFECT = {
    "wall_clock_breakdown": "this fork logs no step timings",
    "memory_breakdown": "this fork logs no memory figures; benchmarks/memory_breakdown.py measures them",
    "optimizer.legacy_fusion": "upstream's legacy fused fp16 optimizer does not exist here",
    "bf16.immediate_grad_update": "gradients go to ZeRO's reducer from per-parameter hooks at every stage",
    "checkpoint.use_node_local_storage": ("rank 0 writes the model file and every rank its own optimizer file into "
                                          "the save directory, which loading needs every rank to see"),
    "checkpoint.parallel_write.pipeline_stage": "there is no pipeline engine",
    "zero_optimization.use_multi_rank_bucket_allreduce": "each gradient bucket is reduced in one collective",
    "zero_optimization.allgather_partitions": "updated partitions are always all-gathered",
    "zero_optimization.allgather_bucket_size": "each parameter group's partitions are all-gathered in one collective",
    "zero_optimization.round_robin_gradients": "gradients go into each rank's partition as their buckets are reduced",
    "zero_optimization.elastic_checkpoint": "ZeRO checkpoints load at any world size, see checkpoints.md",
    "zero_optimization.ignore_unused_parameters": "upstream's stage-3 check of unused parameters is not made",
    "zero_optimization.stage3_max_reuse_distance": "a gathered unit is released after its forward and its backward",
    "zero_optimization.sub_group_size": "each parameter group steps as one flat partition",
    "zero_optimization.stage3_allgather_sequential": "a unit's parameters are gathered in one collective",
    "zero_optimization.memory_efficient_linear": "linear layers run as the model defines them",
    "zero_optimization.override_module_apply": "module.apply is not wrapped",
    "zero_optimization.log_trace_cache_warnings": "this fork logs no trace-cache misses",
    "zero_optimization.enable_sanity_checks": "upstream's extra partitioning checks are not implemented",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "optimizer state never swaps to NVMe here",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": ("the cpu_adam op runs on torch's intra-op threads, "
                                                               "set with torch.set_num_threads"),
}


# Upstream top-level sections of features not implemented here, refused when the config turns them on.
SECTIONS_REFUSED_WHEN_ON = {
    "amp": "NVIDIA apex AMP is not implemented; use fp16 or bf16",
    "torch_autocast": "the forward runs in the model dtype, never under torch.autocast; use fp16 or bf16",
    "sequence_parallel_size": "sequence parallelism is not implemented",
    "tensor_parallel": "tensor parallelism (AutoTP) is not implemented",
    "expert_parallel": "expert parallelism is not implemented",
    "compile": "DeepCompile is not implemented; engine.compile() compiles the module with torch.compile",
    "compression_training": "compression during training is not implemented",
    "curriculum_learning": "curriculum learning is not implemented",
    "data_efficiency": "data efficiency (data sampling, random layer-token drop) is not implemented",
    "progressive_layer_drop": "progressive layer drop is not implemented",
    "sparse_gradients": "gradients are reduced dense",
    "sparse_attention": "sparse attention is not implemented",
    "hybrid_engine": "the hybrid training/generation engine is not implemented",
    "weight_quantization": "weight quantization is not implemented",
    "elasticity": "elastic batch sizes are not implemented; the batch is what the batch keys say",
}

# Upstream top-level sections of logging, monitoring or tooling not implemented here: a warning names them.
SECTIONS_WITHOUT_EFFECT = {
    "activation_checkpointing": "deepspeed.checkpointing is not implemented; use torch.utils.checkpoint",
    "aio": "there is no NVMe offload",
    "autotuning": "the autotuner is not implemented",
    "comet": "no monitor backends", "csv_monitor": "no monitor backends", "tensorboard": "no monitor backends",
    "wandb": "no monitor backends",
    "comms_logger": "communication is not logged",
    "datastates": "asynchronous checkpoint engines are not implemented", "nebula": "no checkpoint engines",
    "disable_allgather": "updated partitions are always all-gathered",
    "dump_state": "the engine's state is not dumped",
    "eigenvalue": "no eigenvalue computation",
    "flops_profiler": "the flops profiler is not implemented",
    "managed_gradient_accumulation": "gradient accumulation is gradient_accumulation_steps",
    "pipeline": "there is no pipeline engine",
    "seq_parallel_communication_data_type": "sequence parallelism is not implemented",
    "vocabulary_size": "data efficiency is not implemented",
}

_ON_KEYS = ("enabled", "deepcompile", "autotp_size", "tp_size", "expert_parallel_size")


def section_turned_on(value: Any) -> bool:
    """Whether an upstream section's value turns its feature on: true, a size above 1, or (anywhere inside a
    section) `enabled`/`deepcompile` true or a parallel size above 1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value > 1
    if isinstance(value, dict):
        return any(section_turned_on(item) if key in _ON_KEYS or isinstance(item, dict) else False
                   for key, item in value.items())
    return False


def set_keys(model: BaseModel, path: str = "") -> dict[str, tuple[Any, Any]]:
    """Every key of `model` and its sub-sections that the config set to a value other than the default:
    dotted key as written (a field's alias when it has one) -> (value, default)."""
    found = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        key = f"{path}{field.alias or name}"
        if isinstance(value, BaseModel):
            found.update(set_keys(value, key + "."))
            continue
        if name not in model.model_fields_set:
            continue
        default = field.get_default(call_default_factory=True)
        if value != default:
            found[key] = (value, default)
    return found


def check_unused_settings(sections: BaseModel) -> None:
    """Refuse the keys of REFUSED set to other than their default, and warn about those of NO_EFFECT.

    Raises:
        DeepSpeedConfigError: naming every refused key with its value and what this fork does instead.
    """
    found = set_keys(sections)
    refused = [f"{key} = {found[key][0]!r} is not supported by this fork ({REFUSED[key]}); remove the key or set it "
               f"to {found[key][1]!r}" for key in REFUSED if key in found]
    if refused:
        raise DeepSpeedConfigError("; ".join(refused))
    for key, reason in NO_EFFECT.items():
        if key in found:
            logger.warning(f"Config key {key} = {found[key][0]!r} has no effect in this fork: {reason}")
