"""Builders the engine calls once at construction: basic optimizer, ZeRO wrapper, LR scheduler."""

from typing import Optional

import torch

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigAssertionError, DeepSpeedConfigError
from deepspeed.runtime.zero.config import OffloadDeviceEnum
from deepspeed.runtime.zero.step_contract import StepsOnHost

ADAM_OPTIMIZERS = ("adam", "adamw")
MUON_OPTIMIZER = "muon"

UNTESTED_OPTIMIZER_MESSAGE = ('You are using an untested ZeRO Optimizer. Please add <"zero_allow_untested_optimizer": '
                              'true> in the configuration file to use it.')


def model_dtype_of(config: DeepSpeedConfig) -> torch.dtype:
    if config.fp16_enabled:
        return torch.float16
    if config.bfloat16_enabled:
        return torch.bfloat16
    return torch.float32


# Adam's keys that DeepSpeedCPUAdam takes (as torch's, except `amsgrad` and upstream's `bias_correction`).
CPU_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction")

CLIENT_OPTIMIZER_WITH_OFFLOAD_MESSAGE = (
    "zero_optimization.offload_optimizer steps the optimizer on the CPU, but the client optimizer ({name}) has no "
    "CPU step of its own and would run torch's CPU code, usually far slower. Use deepspeed.ops.adam.DeepSpeedCPUAdam "
    "(or let the config's optimizer section build one), or set \"zero_force_ds_cpu_optimizer\": false to keep "
    "this optimizer.")


def _zero_supported_types() -> tuple:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    return (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, MuonWithAuxAdam, DeepSpeedCPUAdam)


def offloads_optimizer(config: DeepSpeedConfig) -> bool:
    """True when ZeRO (stage >= 1) places the optimizer on the CPU (zero_optimization.offload_optimizer)."""
    return config.zero_optimization_stage >= 1 and config.zero_config.has_optimizer_offload


def build_basic_optimizer(engine, client_optimizer, model_parameters) -> Optional[torch.optim.Optimizer]:
    """The unwrapped optimizer: the client's, or one built from the config's `optimizer` section.

    Raises:
        ValueError: the model has no trainable parameters.
        DeepSpeedConfigError: the config's optimizer refuses its `optimizer.params`.
        DeepSpeedConfigAssertionError: ZeRO stage 1 or 2 without an optimizer, or upstream's untested-optimizer rule
            under ZeRO (both an AssertionError, as upstream raises them).
        ZeRORuntimeException: optimizer offload with a client optimizer that has no CPU step of its own, unless
            zero_force_ds_cpu_optimizer is false (as upstream).
        OpBuildError: optimizer offload, and the CPU optimizer op cannot be built here.
    """
    config = engine._config
    engine._client_optimizer = client_optimizer is not None
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    if not trainable and (client_optimizer is not None or config.optimizer_name is not None):
        raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False); "
                         "DeepSpeed needs at least one parameter to optimize")
    optimizer = None
    if isinstance(client_optimizer, torch.optim.Optimizer):
        optimizer = client_optimizer
    elif client_optimizer is not None:
        optimizer = client_optimizer(model_parameters if model_parameters is not None else trainable)
    elif config.optimizer_name is not None:
        named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        params = model_parameters if model_parameters is not None else trainable
        optimizer = optimizer_from_config(config, named, params, engine.module)
    if optimizer is None:
        # Stage 3 runs without one (upstream's ZeRO-3 inference: the Trainer's evaluate or predict before train).
        if 1 <= config.zero_optimization_stage <= 2:
            raise DeepSpeedConfigAssertionError(f"zero stage {config.zero_optimization_stage} requires an optimizer")
        return None
    if client_optimizer is not None:
        _check_client_optimizer_for_offload(config, optimizer)
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if len(g["params"]) > 0]
    _check_no_duplicate_params(engine, optimizer)
    if config.zero_optimization_stage >= 1 and type(optimizer) not in _zero_supported_types():
        if not config.zero_allow_untested_optimizer:
            raise DeepSpeedConfigAssertionError(UNTESTED_OPTIMIZER_MESSAGE)
    return optimizer


def optimizer_from_config(config: DeepSpeedConfig, named_params, params,
                          module: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """The optimizer the config's `optimizer` section describes.

    Args:
        config: the parsed config (its `optimizer_params` are already checked, see runtime/optimizer_params.py).
        named_params: (name, param) pairs of the trainable parameters (Muon's groups are built from them).
        params: what a torch optimizer is given (the client's `model_parameters`, else the trainable params).
        module: the model; Muon tags its attention projections for `per_head_muon` (and checks user head counts).

    Raises:
        DeepSpeedConfigError: the torch optimizer's constructor refuses a key or value of `optimizer.params`.
    """
    name = config.optimizer_name
    kwargs = dict(config.optimizer_params or {})
    if name == MUON_OPTIMIZER:
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam, muon_param_groups
        from deepspeed.runtime.zero.muon.per_head import tag_attention_heads
        groups = muon_param_groups(named_params, kwargs)
        per_head_muon = kwargs.get("per_head_muon") or False
        if module is not None:
            # Before the optimizer: it orders (and ZeRO lays out) a group's matrices by shape and head count.
            try:
                tag_attention_heads(module, per_head_muon)
            except ValueError as exc:
                raise DeepSpeedConfigError(str(exc)) from exc
        elif per_head_muon:
            raise DeepSpeedConfigError("optimizer.params.per_head_muon needs the model (its config names the head "
                                       "counts); build the optimizer through deepspeed.initialize")
        # optimizer.params.lr is what a single LR-schedule value stands for (both groups follow it in proportion).
        return MuonWithAuxAdam(groups, lr=kwargs.get("lr"))
    if name in ADAM_OPTIMIZERS:
        kwargs.pop("torch_adam", None)
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        if offloads_optimizer(config):
            return _cpu_adam(params, kwargs, adamw_mode=name == "adamw" or adam_w_mode)
        cls = torch.optim.AdamW if (name == "adamw" or adam_w_mode) else torch.optim.Adam
    else:
        cls = getattr(torch.optim, "SGD" if name == "sgd" else name)
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as exc:
        # Keys this fork does not check itself (e.g. momentum for SGD, foreach) are torch's to refuse.
        raise DeepSpeedConfigError(f"optimizer.params {kwargs} are refused by torch.optim.{cls.__name__} "
                                   f"(optimizer.type '{name}'): {exc}") from exc


def _cpu_adam(params, kwargs: dict, adamw_mode: bool) -> torch.optim.Optimizer:
    """DeepSpeedCPUAdam for optimizer type adam/adamw under optimizer offload (upstream's choice too)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    refused = sorted(set(kwargs) - set(CPU_ADAM_KEYS))
    if refused:
        raise DeepSpeedConfigError(f"optimizer.params {refused} are not taken by DeepSpeedCPUAdam, which steps the "
                                   "optimizer under zero_optimization.offload_optimizer; it takes "
                                   f"{list(CPU_ADAM_KEYS)}")
    return DeepSpeedCPUAdam(params, adamw_mode=adamw_mode, **kwargs)


def _check_client_optimizer_for_offload(config: DeepSpeedConfig, optimizer: torch.optim.Optimizer) -> None:
    """Upstream's zero_force_ds_cpu_optimizer rule, asked as a capability: an optimizer that steps on the host with
    the native op (DeepSpeedCPUAdam; MuonWithAuxAdam, which also orthogonalises on the accelerator) passes."""
    if not offloads_optimizer(config) or not config.zero_force_ds_cpu_optimizer:
        return
    if isinstance(optimizer, StepsOnHost):
        return
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    raise ZeRORuntimeException(CLIENT_OPTIMIZER_WITH_OFFLOAD_MESSAGE.format(name=type(optimizer).__name__))


def _check_no_duplicate_params(engine, optimizer) -> None:
    names = {id(p): n for n, p in engine.module.named_parameters()}
    seen = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in seen:
                raise ValueError(f"Parameter with name: {names.get(id(param), '<unnamed>')} occurs multiple times "
                                 "in optimizer.param_groups. Make sure it only appears once to prevent undefined "
                                 "behavior.")
            seen.add(id(param))


def build_zero_optimizer(engine, basic_optimizer):
    """Wrap the basic optimizer in DeepSpeedZeroOptimizer (stages 0-2) or DeepSpeedZeroOptimizer_Stage3."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.zero.options import ZeroOptions
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    config = engine._config
    model_dtype = model_dtype_of(config)
    zero = config.zero_config
    offload = _offload_section(config)
    fp16 = config.float16_config
    options = ZeroOptions(
        stage=config.zero_optimization_stage,
        model_dtype=model_dtype,
        accum_dtype=config.grad_accum_dtype or model_dtype,
        comm_dtype=config.communication_data_type or model_dtype,
        reduce_scatter=zero.reduce_scatter,
        overlap_comm=bool(zero.overlap_comm),
        contiguous_gradients=zero.contiguous_gradients,
        reduce_bucket_size=int(zero.reduce_bucket_size),
        clip_grad=config.gradient_clipping,
        check_overflow=_checks_overflow(config),
        average=config.gradient_allreduce_op == "mean",
        offload_optimizer=offload,
    )
    dynamic = config.fp16_enabled and fp16.loss_scale == 0
    static_scale = fp16.loss_scale if config.fp16_enabled else 1.0
    loss_scaler = CreateLossScaler(dtype=model_dtype, static_loss_scale=static_scale, dynamic_scaling=dynamic,
                                   dynamic_loss_args=engine.dynamic_loss_scale_args())
    param_names = {p: n for n, p in engine.module.named_parameters()}
    if config.zero_optimization_stage == 3:
        from deepspeed.runtime.zero.param_residency import ResidencyOptions
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.partition_placement import PartitionPlacement
        residency = ResidencyOptions(persistence_threshold=int(zero.param_persistence_threshold),
                                     model_persistence_threshold=int(zero.model_persistence_threshold),
                                     prefetch_numel=int(zero.prefetch_bucket_size),
                                     max_live_numel=int(zero.max_live_parameters))
        try:
            placement = PartitionPlacement.from_config(engine.device, zero.offload_param)
        except ValueError as error:
            raise DeepSpeedConfigError(str(error)) from None
        return DeepSpeedZeroOptimizer_Stage3(engine.module, basic_optimizer, param_names, options, loss_scaler,
                                             engine.dp_process_group, engine.device, residency, placement)
    return DeepSpeedZeroOptimizer(basic_optimizer, param_names, options, loss_scaler, engine.dp_process_group,
                                  engine.device)


def _offload_section(config: DeepSpeedConfig):
    """zero_optimization.offload_optimizer when it offloads to the CPU, else None; NVMe is refused.

    (offload_param needs stage 3, which the config validation refuses otherwise; its placement is
    zero/partition_placement.py's.)
    """
    if not offloads_optimizer(config):
        return None
    section = config.zero_config.offload_optimizer
    device = OffloadDeviceEnum(section.device).value
    if device != OffloadDeviceEnum.cpu.value:
        raise DeepSpeedConfigError(f"zero_optimization.offload_optimizer.device '{device}' is not "
                                   "implemented in this fork: NVMe offload needs upstream's asynchronous I/O op, "
                                   "which is not built here; use 'cpu' (masters and optimizer state in host memory) "
                                   "or 'none'")
    if section.super_offload:
        raise DeepSpeedConfigError("zero_optimization.offload_optimizer.super_offload is not implemented in this fork "
                                   "(upstream's SuperOffload pipeline); set it to false: the offloaded step runs "
                                   "in the cpu_adam op")
    return section


# Stage-3 keys whose non-default values this fork does not implement: key -> (default, what to do instead).
_STAGE3_UNIMPLEMENTED = {
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning is not implemented; use 1"),
    "zero_quantized_weights": (False, "ZeRO++ quantized weights are not implemented; use false"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized weights are not implemented; use false"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized gradients are not implemented; use false"),
    "zeropp_loco_param": (None, "ZeRO++ LoCo is not implemented; remove the key"),
    "mics_shard_size": (-1, "MiCS is not implemented; use -1"),
    "mics_hierarchical_params_gather": (False, "MiCS is not implemented; use false"),
    "use_all_reduce_for_fetch_params": (False, "parameters are fetched with all-gather; use false"),
    "module_granularity_threshold": (0, "modules are fetched one by one; use 0"),
    "pipeline_loading_checkpoint": (False, "checkpoints load in one pass; use false"),
}


def reject_unimplemented_zero(config: DeepSpeedConfig) -> None:
    """Refuse ZeRO settings this fork does not implement (an offload device other than the CPU, stage-3 keys set to
    what it does not do) rather than silently ignoring them, before anything is built: building the basic optimizer
    may compile an op (CPU Adam: seconds to minutes) only for the config to be refused after it."""
    _offload_section(config)
    if config.zero_optimization_stage != 3:
        return
    zero = config.zero_config
    for key, (default, advice) in _STAGE3_UNIMPLEMENTED.items():
        value = getattr(zero, key)
        if value != default:
            raise DeepSpeedConfigError(f"zero_optimization.{key} {value!r} is not supported with "
                                       f"zero_optimization.stage 3 by this fork: {advice}")
    if zero.has_optimizer_offload and zero.offload_optimizer.ratio < 1:
        raise DeepSpeedConfigError(f"zero_optimization.offload_optimizer.ratio {zero.offload_optimizer.ratio} "
                                   "(partial offload) is not implemented in this fork: every master and all "
                                   "optimizer state go to the CPU; use 1.0")


def _checks_overflow(config: DeepSpeedConfig) -> bool:
    if config.fp16_enabled:
        return True
    if config.bfloat16_enabled:
        return config.bfloat16_config.check_grad_overflow
    return False


def build_lr_scheduler(engine, client_scheduler):
    """The client's scheduler (instance, or callable given the basic optimizer), else the config's, else None.

    Raises:
        DeepSpeedConfigError: an unknown scheduler type, or `scheduler.params` its constructor refuses.
    """
    if client_scheduler is not None:
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(engine.basic_optimizer)
        return client_scheduler
    config = engine._config
    if config.scheduler_name is None or engine.basic_optimizer is None:
        return None
    from deepspeed.runtime import lr_schedules
    params = dict(config.scheduler_params or {})
    name = config.scheduler_name
    if hasattr(lr_schedules, name):
        cls, optimizer = getattr(lr_schedules, name), engine.optimizer
    elif hasattr(torch.optim.lr_scheduler, name):
        cls, optimizer = getattr(torch.optim.lr_scheduler, name), engine.basic_optimizer
    else:
        raise DeepSpeedConfigError(f"DeepSpeed does not recognize LR scheduler {name}")
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError) as exc:
        raise DeepSpeedConfigError(f"scheduler.params {params} are refused by {name}: {exc}") from exc
