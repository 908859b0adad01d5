"""DeepSpeedEngine: forward, backward, step and the counters; everything else is delegated."""

import os
from collections.abc import Callable, Iterable
from typing import Optional, Union

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.engine_setup import (build_basic_optimizer, build_lr_scheduler, build_zero_optimizer,
                                            model_dtype_of, reject_unimplemented_zero)
from deepspeed.runtime.engine_state import CheckpointSettings, EngineState, TrainingCounters
from deepspeed.utils.logging import log_dist, set_log_level
from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config

# Upstream's types of the `optimizer` and `lr_scheduler` callables deepspeed.initialize accepts.
DeepSpeedOptimizerCallable = Callable[[Union[Iterable[torch.nn.Parameter], dict[str, Iterable]]],
                                      torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

LOCAL_RANK_MESSAGE = ("DeepSpeed requires the LOCAL_RANK environment variable, it is set by the deepspeed launcher, "
                      "deepspeed.init_distributed, or the torch's launcher. If using a different launcher please "
                      "ensure LOCAL_RANK is set prior to initializing deepspeed.")


class DeepSpeedEngine(torch.nn.Module):
    """Training engine: wraps the model, the (ZeRO) optimizer, the LR scheduler and the step counters.

    Args mirror upstream's constructor; `config_class` is a parsed DeepSpeedConfig (built from `config`
    when None).
    """

    def __init__(self, args, model: torch.nn.Module, optimizer=None, model_parameters=None, training_data=None,
                 lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
                 config_class: Optional[DeepSpeedConfig] = None, mesh_device=None, dont_change_device=False):
        super().__init__()
        self._config = config_class if config_class is not None else DeepSpeedConfig(config, mpu)
        self.config = self._config._param_dict
        if self._config.log_level:
            set_log_level(self._config.log_level)
        reject_unimplemented_zero(self._config)
        self._set_distributed_attributes(args)
        self.module = model
        self._prepare_module(dont_change_device)
        self.basic_optimizer = build_basic_optimizer(self, optimizer, model_parameters)
        self.optimizer = build_zero_optimizer(self, self.basic_optimizer) if self.basic_optimizer else None
        if self.optimizer is None and self._config.zero_optimization_stage == 3:
            # Nothing to partition for: the parameters are whole on every rank (forward only, see zero3.md).
            from deepspeed.runtime.zero.init_partition import materialise_init_params
            materialise_init_params(self.module, self.device, model_dtype_of(self._config))
        self.lr_scheduler = build_lr_scheduler(self, lr_scheduler)
        self.training_dataloader = self.deepspeed_io(training_data, collate_fn) if training_data is not None else None
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._backwards_since_step = 0
        self._gradients_pending = False  # a backward since the last optimizer step (checkpoint_state)
        self._step_applied = False
        self._is_boundary_override: Optional[bool] = None
        self.loaded_checkpoint_dp_world_size = None
        self.loaded_checkpoint_mp_world_size = None

    # ------------------------------------------------------------------ construction helpers
    def _set_distributed_attributes(self, args) -> None:
        if "LOCAL_RANK" not in os.environ and "OMPI_COMM_WORLD_LOCAL_RANK" not in os.environ:
            raise AssertionError(LOCAL_RANK_MESSAGE)
        self.local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
        if args is not None and getattr(args, "local_rank", None) is not None and args.local_rank >= 0:
            if args.local_rank != self.local_rank:
                raise AssertionError(f"Mismatch in local rank setting, args.local_rank={args.local_rank} but "
                                     f"env['LOCAL_RANK']={self.local_rank}")
        if args is not None and hasattr(args, "local_rank"):
            args.local_rank = self.local_rank
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dp_world_size = self.world_size
        self.mp_world_size = 1
        self.seq_dp_world_size = self.dp_world_size
        self.dp_process_group = None
        accelerator = get_accelerator()
        if accelerator.device_name() != "cpu":
            accelerator.set_device(self.local_rank)
            self.device = torch.device(accelerator.device_name(self.local_rank))
        else:
            self.device = torch.device("cpu")

    def _prepare_module(self, dont_change_device: bool) -> None:
        """Cast floating parameters to the model dtype, move to the device, and broadcast from rank 0."""
        # Flags only (upstream sets them at every stage); stage 3 reads them when it builds its units.
        apply_zero_leaf_module_config(self.module, self._config.zero_config.leaf_module)
        dtype = model_dtype_of(self._config)
        if dtype == torch.float16 and not get_accelerator().is_fp16_supported():
            raise DeepSpeedConfigError("Type fp16 is not supported on your device.")
        if dtype == torch.bfloat16 and not get_accelerator().is_bf16_supported():
            raise DeepSpeedConfigError("Type bf16 is not supported on your device.")
        if self._config.zero_optimization_stage != 3 and any(
                getattr(p, "ds_tensor", None) is not None for p in self.module.parameters()):
            raise ValueError("the model was built under deepspeed.zero.Init, which partitions its parameters: it "
                             f"needs zero_optimization.stage 3, got {self._config.zero_optimization_stage}")
        for param in self.module.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        if not dont_change_device:
            self.module.to(self.device)
        if self.dp_world_size > 1:
            for tensor in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(tensor.data, src=0, group=self.dp_process_group)

    # ------------------------------------------------------------------ forward / backward / step
    def forward(self, *inputs, **kwargs):
        if self._config.fp16_enabled and self._config.float16_config.auto_cast:
            inputs = tuple(x.half() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
            kwargs = {k: v.half() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
        return self.module(*inputs, **kwargs)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the live loss scale, for scripts that call backward themselves."""
        return self.optimizer.scale_loss(loss) if self.optimizer is not None else loss

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` scaled by the loss scale (and 1/gradient_accumulation_steps).

        Returns:
            The loss divided by gradient_accumulation_steps (when `scale_wrt_gas`), unscaled.

        Raises:
            AssertionError: without an optimizer, or when `loss` is not a scalar with a graph.
        """
        if self.optimizer is None:
            raise AssertionError("must provide optimizer during init in order to use backward")
        if not (torch.is_tensor(loss) and loss.dim() == 0 and loss.grad_fn is not None):
            raise AssertionError("loss must be a scalar tensor. If you need to pass output gradients, backward() "
                                 "of output tensors")
        gas_factor = 1.0 / self.gradient_accumulation_steps() if scale_wrt_gas else 1.0
        scaled = self.optimizer.scale_loss(loss) * gas_factor
        backward_prologue = getattr(self.optimizer, "backward_prologue", None)
        if backward_prologue is not None:
            backward_prologue(self.is_gradient_accumulation_boundary())
        scaled.backward(retain_graph=retain_graph)
        self.optimizer.backward_epilogue(self.is_gradient_accumulation_boundary())
        self._backwards_since_step += 1
        self._gradients_pending = True
        return loss.detach() * gas_factor

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Count a micro-step; at the accumulation boundary run the optimizer's transactional step.

        Raises:
            AssertionError: without an optimizer.
            RuntimeError: when no backward() ran since the previous step().
        """
        if self.optimizer is None:
            raise AssertionError("must provide optimizer during init in order to use step")
        if self._backwards_since_step == 0:
            raise RuntimeError("engine.step() was called without engine.backward(loss) since the previous step; "
                               "call engine.backward(loss) on each micro-batch's loss before engine.step()")
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1
        self._backwards_since_step = 0

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        outcome = self.optimizer.step()
        self._step_applied = outcome.applied
        self.zero_grad()
        self._gradients_pending = False
        if outcome.applied:
            if self.lr_scheduler is not None:
                self._step_lr_scheduler(lr_kwargs)
        else:
            self.skipped_steps += 1
        spp = self._config.steps_per_print
        if spp and (self.global_steps + 1) % spp == 0:
            log_dist(f"step={self.global_steps + 1}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
                     f"mom={self.get_mom()}", ranks=[0])
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _step_lr_scheduler(self, lr_kwargs: Optional[dict]) -> None:
        try:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        except TypeError:
            self.lr_scheduler.step(self.train_batch_size())

    def zero_grad(self) -> None:
        for param in self.module.parameters():
            param.grad = None

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_boundary_override is not None:
            return self._is_boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._is_boundary_override = is_boundary

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> float:
        return self.optimizer._global_grad_norm if self.optimizer is not None else None

    # ------------------------------------------------------------------ data
    def deepspeed_io(self, dataset, collate_fn=None, batch_size=None, route=None, pin_memory=True,
                     data_sampler=None, num_local_io_workers=None):
        """A DataLoader over `dataset` that gives each data-parallel rank its own micro-batches."""
        if data_sampler is None:
            data_sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=self.dp_world_size,
                                                                           rank=dist.get_rank(), shuffle=False)
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                                           sampler=data_sampler, collate_fn=collate_fn,
                                           num_workers=num_local_io_workers or 0,
                                           drop_last=self._config.dataloader_drop_last)

    # ------------------------------------------------------------------ config getters scripts call
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def zero_optimization(self) -> bool:
        return self._config.zero_enabled

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization_stage

    def fp16_enabled(self) -> bool:
        return self._config.fp16_enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bfloat16_enabled

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def steps_per_print(self):
        return self._config.steps_per_print

    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16_enabled and self._config.float16_config.loss_scale == 0

    def loss_scale(self) -> float:
        """The config's static fp16.loss_scale (0 under dynamic scaling), as upstream; see cur_scale."""
        return self._config.float16_config.loss_scale

    def initial_dynamic_scale(self) -> float:
        return 2**self._config.float16_config.initial_scale_power

    def dynamic_loss_scale_args(self) -> Optional[dict]:
        fp16 = self._config.float16_config
        if not self.dynamic_loss_scale():
            return None
        return {"init_scale": 2**fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def get_data_types(self):
        model_dtype = model_dtype_of(self._config)
        return model_dtype, self._config.grad_accum_dtype or model_dtype

    @property
    def communication_data_type(self) -> torch.dtype:
        return self._config.communication_data_type or model_dtype_of(self._config)

    def optimizer_name(self) -> Optional[str]:
        return type(self.basic_optimizer).__name__ if self._client_optimizer else self._config.optimizer_name

    def get_lr(self) -> list:
        return [group["lr"] for group in self.basic_optimizer.param_groups] if self.basic_optimizer else []

    def get_mom(self) -> list:
        if self.basic_optimizer is None:
            return []
        moms = []
        for group in self.basic_optimizer.param_groups:
            moms.append(group["betas"] if "betas" in group else group.get("momentum", 0.0))
        return moms

    # ------------------------------------------------------------ checkpoints (deepspeed/checkpoint/engine_io.py)
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False) -> bool:
        from deepspeed.checkpoint.engine_io import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        from deepspeed.checkpoint.engine_io import load_checkpoint
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, custom_load_fn)

    def checkpoint_state(self) -> EngineState:
        """What a checkpoint saves from and loads into (deepspeed/runtime/engine_state.py)."""
        config = self._config
        return EngineState(
            module=self.module, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            counters=TrainingCounters(self.global_steps, self.global_samples, self.skipped_steps, self.micro_steps),
            dp_world_size=self.dp_world_size, mp_world_size=self.mp_world_size,
            zero_stage=self.zero_optimization_stage(),
            precision="fp16" if self.fp16_enabled() else "bf16" if self.bfloat16_enabled() else "fp32",
            ds_config=self.config,
            settings=CheckpointSettings(
                serialization=config.checkpoint_config.checkpoint_serialization,
                tag_validation=str(config.checkpoint_config.tag_validation),
                load_universal=config.load_universal_checkpoint,
                load_from_fp32_weights=config.zero_config.load_from_fp32_weights,
                gather_16bit_weights_on_model_save=config.zero_config.gather_16bit_weights_on_model_save),
            train_batch_size=self.train_batch_size(), gradient_accumulation_steps=self.gradient_accumulation_steps(),
            gradients_pending=self._gradients_pending)

    def restore_checkpoint_state(self, counters: Optional[TrainingCounters], dp_world_size: int,
                                 mp_world_size: int) -> None:
        """After a load: the saved counters (None: keep these) and the world sizes the checkpoint was saved at."""
        if counters is not None:
            self.global_steps, self.global_samples = counters.global_steps, counters.global_samples
            self.skipped_steps, self.micro_steps = counters.skipped_steps, counters.micro_steps
        self.loaded_checkpoint_dp_world_size = dp_world_size
        self.loaded_checkpoint_mp_world_size = mp_world_size

    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def empty_partition_cache(self) -> None:
        """Release every gathered stage-3 parameter that is not persistent (no-op at stages 0-2)."""
        residency = getattr(self.optimizer, "residency", None)
        if residency is not None:
            residency.release_all()

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the model's 16-bit (model dtype) state dict on rank 0; every rank must call it at stage 3.

        Returns:
            True when saved; False at stage 3 without zero_optimization.gather_16bit_weights_on_model_save
            (upstream's rule: gathering the whole model may not fit; use zero_to_fp32 instead).
        """
        from deepspeed.checkpoint.module_state import save_16bit_model
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether stage 3 may gather the whole 16-bit model to save it
        (zero_optimization.stage3_gather_16bit_weights_on_model_save)."""
        return bool(self._config.zero_config.gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole model's state dict in the model dtype, on the CPU of rank 0 (None on other ranks).

        Stage 3 only, and a collective: every rank must call it (each parameter is gathered in turn). Every key of
        ``module.state_dict()`` is there with its full shape, tied weights included (they share one tensor).

        Raises:
            ValueError: not at ZeRO stage 3 (upstream's rule; at stages 0-2 ``engine.module.state_dict()`` is whole).
        """
        from deepspeed.checkpoint.module_state import consolidated_16bit_state_dict
        return consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def compile(self, backend: Optional[str] = None, compile_kwargs: Optional[dict] = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """torch.compile the wrapped module's forward (upstream's signature; accelerate calls it for its dynamo
        plugin). The engine's step is not compiled.

        Args:
            backend: torch.compile's backend; default the accelerator's (`get_compile_backend()`).
            compile_kwargs: further torch.compile keywords (mode, dynamic, fullgraph, options).
            schedule, compiled_autograd_enabled: DeepCompile's; not implemented (refused when set).

        Raises:
            NotProvidedError: a DeepCompile argument, or ZeRO stage 3 (its parameter gathering runs in module hooks
                that this fork has not made traceable).
        """
        from deepspeed.not_provided import NotProvidedError
        if schedule is not None or compiled_autograd_enabled:
            raise NotProvidedError("engine.compile(schedule=..., compiled_autograd_enabled=True) asks for "
                                   "DeepCompile, which this fork does not implement; call "
                                   "engine.compile(backend, compile_kwargs)")
        if self.zero_optimization_stage() == 3:
            raise NotProvidedError("engine.compile at ZeRO stage 3 is not provided by this fork (stage 3 gathers "
                                   "parameters in module hooks it has not made traceable); use stage 0-2 to compile, "
                                   "or train stage 3 uncompiled")
        backend = backend or get_accelerator().get_compile_backend()
        self.module.compile(backend=backend, **(compile_kwargs or {}))
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether `compile` was called."""
        return self.__dict__.get("_is_compiled", False)

    def destroy(self) -> None:
        if self.optimizer is not None:
            self.optimizer.destroy()

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise
