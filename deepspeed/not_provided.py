"""Upstream DeepSpeed names that this fork does not provide, and stand-ins that fail on use saying what to use.

Scripts written for upstream DeepSpeed import names at the top that they may never use (`from deepspeed.ops.adam
import FusedAdam` behind a GPU flag). So each package below answers its missing upstream names with a
stand-in instead of an ImportError: the import succeeds, and the first real use (calling it, instantiating it,
reading an attribute, or using a constant's value) raises `NotProvidedError` naming the name and what this fork
offers instead. Names upstream does not have still raise AttributeError. A package opts in with
`__getattr__ = module_getattr(__name__)`; providing a name for real is deleting its row here and defining it.
docs/upstream-differences.md lists every row (tests/unit/test_upstream_names.py keeps the two equal).
"""

from collections.abc import Callable
from typing import Any, NamedTuple


class NotProvidedError(NotImplementedError):
    """An upstream DeepSpeed name this fork does not provide was used; the message says what to use instead."""


class NotProvidedAttributeError(NotProvidedError, AttributeError):
    """An attribute of a stand-in was read. Also an AttributeError, so `hasattr` and `getattr(x, name, default)`
    keep working on stand-ins."""


class Missing(NamedTuple):
    """One upstream name this fork does not provide."""

    advice: str
    # A constant or module state rather than a class, function or module: it fails when its value is used.
    is_value: bool = False


def _callables(advice: str, *names: str) -> dict[str, Missing]:
    return {name: Missing(advice) for name in names}


def _values(advice: str, *names: str) -> dict[str, Missing]:
    return {name: Missing(advice, is_value=True) for name in names}


ZERO3 = ("this part of ZeRO stage 3 (external parameters, upstream's parameter-offload classes, tiled linear layers) "
         "is not implemented; stage 3 gathers each module's own parameters around its forward and backward (from "
         "host memory under zero_optimization.offload_param), deepspeed.zero.Init partitions parameters at "
         "construction, and deepspeed.zero.GatheredParameters makes any of them whole")
NATIVE_OPS = ("this fork builds one native op, cpu_adam (CPUAdamBuilder). It steps DeepSpeedCPUAdam, which "
              "optimizer.type Adam and AdamW build under zero_optimization.offload_optimizer device 'cpu', and runs "
              "the element-wise work of Muon's host step under that offload; otherwise the config's optimizer types "
              "(Adam, AdamW, Muon, or any torch.optim class name) build torch optimizers that need no compiled op")
FUSED_ADAM = ("use optimizer.type 'Adam' or 'AdamW' in the config (torch.optim.AdamW), or torch.optim.AdamW directly "
              "(fused=True on CUDA); FusedAdam's own state layout and bias_correction=False are not reproduced")
ZENFLOW = "ZenFlow is not implemented (zero_optimization.zenflow is refused); use optimizer.type 'AdamW'"
LAMB_LION = "this optimizer is not implemented; use another optimizer.type (Adam, AdamW, Muon or a torch.optim class)"
ADAGRAD = "use torch.optim.Adagrad, or optimizer.type 'Adagrad' in the config"
TRANSFORMER_KERNELS = ("DeepSpeed's fused transformer kernels are not implemented; use your model's own (or "
                       "torch.nn's) transformer layers")
INFERENCE = "DeepSpeed inference is not implemented; run the trained model with plain PyTorch (engine.module)"
PIPELINE = ("pipeline parallelism is not implemented; this fork trains the whole model on every rank (data parallel "
            "with ZeRO stages 0-3)")
TENSOR_PARALLEL = ("tensor and model parallelism are not implemented; this fork is data parallel only (model-parallel "
                   "size 1)")
INJECTION = "kernel injection and automatic tensor parallelism are not implemented"
HYBRID = "the hybrid (training + generation) engine is not implemented; use deepspeed.initialize's DeepSpeedEngine"
DATALOADER = ("deepspeed.initialize(training_data=...) and engine.deepspeed_io() return a torch.utils.data.DataLoader "
              "over a DistributedSampler")
ACTIVATION_CHECKPOINTING = "activation checkpointing is not implemented; use torch.utils.checkpoint.checkpoint"
ON_DEVICE = ("build the model under `with torch.device(...)` (e.g. 'meta') and in the dtype you need; the engine "
             "casts floating-point parameters to the configured precision")
PER_HEAD_MUON = ("upstream's re-derivation of head counts after tensor-parallel sharding, and its constants naming "
                 "kinds of projection, are not provided (this fork has no tensor parallelism); per-head Muon is "
                 "optimizer.params.per_head_muon, or muon_num_heads / muon_head_dim set on a parameter (docs/muon.md)")
DIST_GLOBAL = "use deepspeed.comm (import deepspeed.comm as dist)"
GROUPS = ("this fork has one process group, the world, for data parallelism and no model parallelism: use "
          "deepspeed.comm.get_world_size() / get_rank() / get_world_group() for data parallelism, and 1 / 0 for the "
          "model-parallel size / rank")
HP_MAPPING = ("upstream's fragment-mapping internals are not provided; read full tensors with deepspeed.utils."
              "safe_get_full_fp32_param / safe_get_full_grad / safe_get_full_optimizer_state and write them with "
              "safe_set_full_fp32_param / safe_set_full_grad / safe_set_full_optimizer_state")
LOCAL_FRAGMENTS = ("use the full-tensor helpers deepspeed.utils.safe_get_full_fp32_param / safe_get_full_grad / "
                   "safe_get_full_optimizer_state / safe_set_full_fp32_param / safe_set_full_grad / "
                   "safe_set_full_optimizer_state")
COMMS_LOGGER = "the communication logger is not implemented (deepspeed.comm.log_summary logs nothing)"
COLLECTIVE = ("this collective is not wrapped by deepspeed.comm; call torch.distributed's on the process group that "
              "deepspeed.init_distributed created (torch's default group)")
COMM_BACKEND = ("deepspeed.comm runs on torch.distributed's default process group; backend objects and names are not "
                "provided (get_accelerator().communication_backend_name() names the backend)")
LAUNCHER_ENV = ("MPI, AzureML, AWS SageMaker and DLTS environment discovery are not implemented; launch with the "
                "deepspeed launcher or torchrun, which set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
UNIVERSAL_CHECKPOINT = ("upstream's checkpoint classes, reshaping tools and key constants are not provided; "
                        "engine.load_checkpoint regroups a checkpoint to any world size and ZeRO stage 0-3, "
                        "python -m deepspeed.checkpoint.ds_to_universal writes the universal form, and "
                        "deepspeed.utils.zero_to_fp32 consolidates the weights (docs/checkpoints.md)")
QUANTIZATION = "DeepSpeed's quantization kernels are not implemented"
TRITON_KERNELS = ("DeepSpeed's Triton kernels are not provided; import triton / triton.language yourself, and ask "
                  "get_accelerator().is_triton_supported() whether Triton can run here")
NVME = "NVMe / GPUDirect Storage offload is not implemented"
DEEP_COMPILE = "DeepCompile is not implemented; torch.compile the model yourself"
PIN_MEMORY = "use get_accelerator().pin_memory(tensor)"
EVOFORMER = "DeepSpeed4Science's Evoformer attention kernel is not implemented"
RANDOM_LTD = "random layer token drop (data efficiency) is not implemented"
NUMA = "NUMA core binding (the launcher's --bind_cores_to_rank) is not implemented"
SEQUENCE_PARALLEL = ("sequence parallelism (Ulysses / ALST) is not implemented; this fork is data parallel only: "
                     "train with sequence-parallel size 1 (accelerate: no parallelism_config sp_size > 1)")
MODULE_UTILS = "use functools.reduce(getattr, name.split('.'), module) / setattr on the parent"

_OP_BUILDERS = (
    "AsyncIOBuilder", "CCLCommBuilder", "CPUAdagradBuilder", "CPULionBuilder", "DeepCompileBuilder",
    "EvoformerAttnBuilder", "FPQuantizerBuilder", "FlashAttentionBuilder", "FusedAdamBuilder", "FusedLambBuilder",
    "FusedLionBuilder", "GDSBuilder", "InferenceBuilder", "InferenceCoreBuilder", "InferenceCutlassBuilder",
    "NotImplementedBuilder", "PinMemoryBuilder", "QuantizerBuilder", "RaggedOpsBuilder",
    "RaggedUtilsBuilder", "RandomLTDBuilder", "ShareMemCommBuilder", "SpatialInferenceBuilder",
    "StochasticTransformerBuilder", "TransformerBuilder", "UtilsBuilder", "get_default_compute_capabilities",
)
_CHECKPOINT_CONSTANTS = (
    "AFFINE_MAP", "AFFINE_MAP_PARAMS", "AFFINE_MAP_VERSION", "AUTOEP_AFFINE_MAPS", "AUTOEP_EP_SIZE",
    "AUTOEP_EXPERT_KEY_PREFIX", "AUTOEP_EXPERT_PLACEMENT", "AUTOEP_LAYERS_KEY", "AUTOEP_LAYERS_KEY_LEGACY",
    "AUTOEP_NUM_EXPERTS", "AUTOEP_NUM_LOCAL_EXPERTS", "AUTOEP_PARAM_EP_RANK", "AUTOEP_PARAM_LOCAL_EXPERTS",
    "AUTOEP_PARAM_LOGICAL_SHAPE", "AUTOEP_PLACEMENT_EP_SIZE", "AUTOEP_PLACEMENT_EXPERTS",
    "AUTOEP_PLACEMENT_NUM_EXPERTS", "AUTOEP_PLACEMENT_RANK", "AUTOEP_PLACEMENT_RANKS", "AUTOEP_PLACEMENT_VERSION",
    "AUTOEP_PLACEMENT_VERSION_KEY", "AUTOEP_ZERO12_REQUIRED_FIELDS", "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY",
    "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION", "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY",
    "AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT", "AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS", "BASE_OPTIMIZER_STATE",
    "BASE_OPTIMIZER_STATE_STEP", "BF16_ZERO_FILE_PREFIX", "BUFFER_NAMES", "CAT_DIM", "CHECKPOINT_PARALLEL_DIMS",
    "CHECKPOINT_PP_DEGREE", "CHECKPOINT_TP_DEGREE", "CLIP_GRAD", "DS_AUTOEP_UC_META", "DS_AUTOTP_UC_META",
    "DS_VERSION", "EP_IS_EXPERT_PARAM", "EP_NUM_EXPERTS", "EXPERT_PARAMETER_PATTERNS", "FOLDING_DISPATCH_STRATEGY",
    "FOLDING_EP_RANK", "FOLDING_EP_SIZE", "FOLDING_ETP_RANK", "FOLDING_ETP_SIZE", "FOLDING_FAMILY",
    "FOLDING_METADATA_KEY", "FOLDING_METADATA_VERSION", "FOLDING_PARAM_FAMILIES", "FOLDING_SHARED_EXPERT_PLACEMENT",
    "FOLDING_TP_RANK", "FOLDING_TP_SIZE", "FOLDING_ZERO_PARTITION_COUNT", "FOLDING_ZERO_PARTITION_GROUP",
    "FOLDING_ZERO_PARTITION_RANK", "FP16_ZERO_FILE_PREFIX", "FP32_FLAT_GROUPS", "FP32_GROUPS", "FP32_WEIGHT_KEY",
    "FROZEN_PARAM_FRAGMENTS", "FROZEN_PARAM_SHAPES", "GROUP_PADDINGS", "LAYER_FILE_PREFIX", "LOSS_SCALER",
    "MODEL_FILE_PREFIX", "MODEL_FILE_SUFFIX", "OPTIMIZER_STATE_DICT", "OPTIM_FILE_SUFFIX", "ORIGINAL_VOCAB_SIZE",
    "PADDED_VOCAB_SIZE", "PARAM", "PARAMETER_TO_AVERAGE_PATTERNS", "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0",
    "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS", "PARAMETER_WITH_SUB_PARAMS", "PARAM_ALIGNMENT_PADDINGS",
    "PARAM_GROUPS", "PARAM_N_SUB_PARAMS", "PARAM_SHAPES", "PARAM_SLICE_MAPPINGS", "PARTITION_COUNT",
    "PIPELINE_REPLICATED_PARAMETER_PATTERNS", "SINGLE_PARTITION_OF_FP32_GROUPS", "SUB_PARAMS_SHAPE",
    "SUB_PARAM_SHAPE", "SUB_PARAM_SHARD_WIDTHS", "TP_REPLICATED_PARAMETER_PATTERNS", "UNIVERSAL_CHECKPOINT_INFO",
    "UNIVERSAL_CHECKPOINT_VERSION_KEY", "UNIVERSAL_CHECKPOINT_VERSION_VALUE", "VOCABULARY_PARAMETER_PATTERNS",
    "VOCAB_TENSOR", "ZERO_FILE_PREFIX", "ZERO_STAGE",
)
_COMM_CONSTANTS = (
    "CCL_BACKEND", "COMMS_LOGGER", "COMMS_LOGGER_DEBUG", "COMMS_LOGGER_DEBUG_DEFAULT", "COMMS_LOGGER_ENABLED",
    "COMMS_LOGGER_ENABLED_DEFAULT", "COMMS_LOGGER_FORMAT", "COMMS_LOGGER_PROF_ALL", "COMMS_LOGGER_PROF_ALL_DEFAULT",
    "COMMS_LOGGER_PROF_OPS", "COMMS_LOGGER_PROF_OPS_DEFAULT", "COMMS_LOGGER_VERBOSE", "COMMS_LOGGER_VERBOSE_DEFAULT",
    "DEFAULT_AML_MASTER_PORT", "DEFAULT_AML_NCCL_SOCKET_IFNAME", "GLOO_BACKEND", "HCCL_BACKEND", "MPI_BACKEND",
    "NCCL_BACKEND", "SCCL_BACKEND",
)

# Module -> upstream (release 0.19.8) names it binds at import that this fork does not provide.
NOT_PROVIDED: dict[str, dict[str, Missing]] = {
    "deepspeed": {
        **_callables(DATALOADER, "DeepSpeedDataLoader"),
        **_callables(HYBRID, "DeepSpeedHybridEngine"),
        **_callables(PIPELINE, "PipelineEngine", "PipelineModule", "DualPipeVEngine", "DualPipeVModule"),
        **_callables(INFERENCE, "InferenceEngine", "DeepSpeedInferenceConfig", "init_inference",
                     "default_inference_config"),
        **_callables(ACTIVATION_CHECKPOINTING, "checkpointing"),
        **_callables(TRANSFORMER_KERNELS, "DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig"),
        **_callables(INJECTION, "module_inject", "replace_transformer_layer", "set_autotp_mode"),
        **_callables(TENSOR_PARALLEL, "tp_model_init", "load_ds_config", "merge_tp_model_init_into_config",
                     "record_tp_model_init_args"),
        **_callables(ON_DEVICE, "OnDevice"),
        **_callables(PER_HEAD_MUON, "resolve_per_head_muon_after_sharding"),
        **_values(PER_HEAD_MUON, "QUERY", "KV", "MLA_Q", "MLA_KV", "NOT_HEAD_BLOCKED"),
        **_values(DIST_GLOBAL, "dist"),
    },
    "deepspeed.ops": {
        **_callables(TRANSFORMER_KERNELS, "DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig"),
    },
    "deepspeed.ops.adam": {
        **_callables(FUSED_ADAM, "FusedAdam"),
        **_callables(ZENFLOW, "ZenFlowCPUAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"),
    },
    "deepspeed.ops.adagrad": _callables(ADAGRAD, "DeepSpeedCPUAdagrad"),
    "deepspeed.ops.lamb": _callables(LAMB_LION, "FusedLamb"),
    "deepspeed.ops.lion": _callables(LAMB_LION, "DeepSpeedCPULion", "FusedLion"),
    "deepspeed.ops.transformer": {
        **_callables(TRANSFORMER_KERNELS, "DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig"),
        **_callables(INFERENCE, "DeepSpeedInferenceConfig", "DeepSpeedTransformerInference",
                     "DeepSpeedMoEInferenceConfig", "DeepSpeedMoEInference"),
    },
    "deepspeed.ops.fp_quantizer": _callables(QUANTIZATION, "FP_Quantize", "Quantizer", "matmul_fp8"),
    "deepspeed.ops.quantizer": {},
    "deepspeed.ops.aio": _callables(NVME, "AsyncIOBuilder"),
    "deepspeed.ops.gds": _callables(NVME, "GDSBuilder"),
    "deepspeed.ops.compile": _callables(DEEP_COMPILE, "DeepCompileBuilder"),
    "deepspeed.ops.pin_memory": _callables(PIN_MEMORY, "PinMemoryBuilder"),
    "deepspeed.ops.deepspeed4science": _callables(EVOFORMER, "DS4Sci_EvoformerAttention", "EvoformerFusedAttention"),
    "deepspeed.ops.random_ltd": _callables(RANDOM_LTD, "gpt_sample_tokens", "bert_sample_tokens", "GatherTokens",
                                           "ScatterTokens"),
    "deepspeed.ops.triton_ops": {
        **_callables(TRITON_KERNELS, "is_triton_available", "group_gemm_triton", "swiglu", "triton", "tl"),
    },
    "deepspeed.ops.op_builder": _callables(NATIVE_OPS, *_OP_BUILDERS),
    "deepspeed.utils": {
        **_callables(COMMS_LOGGER, "get_caller_func"),
        **_callables(ON_DEVICE, "OnDevice"),
        **_callables(GROUPS, "groups", "initialize", "get_tensor_model_parallel_group", "get_model_parallel_group",
                     "get_data_parallel_group", "set_tensor_model_parallel_world_size",
                     "get_tensor_model_parallel_world_size", "get_model_parallel_world_size",
                     "set_tensor_model_parallel_rank", "get_tensor_model_parallel_rank", "get_model_parallel_rank",
                     "get_tensor_model_parallel_src_rank", "get_data_parallel_world_size", "get_data_parallel_rank"),
        **_values(GROUPS, "mpu", "expert_tensor_parallel_world_size", "mesh_device"),
        **_callables("NVTX ranges: use get_accelerator().range_push(name) / range_pop()", "instrument_w_nvtx"),
        **_callables(HP_MAPPING, "get_full_hp_param", "get_hp_fragment_mapping", "fragment_address",
                     "get_full_hp_grad", "map_to_flat_opt_states", "set_full_hp_param", "set_full_hp_grad",
                     "link_hp_params", "lazy_init_hp_params_optimizer_state", "safe_update_full_grad_vectorized"),
        **_callables(LOCAL_FRAGMENTS, "safe_get_local_fp32_param", "safe_get_local_grad",
                     "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
                     "safe_set_local_optimizer_state"),
        **_callables(NUMA, "get_numactl_cmd"),
        **_callables(MODULE_UTILS, "recursive_getattr", "recursive_setattr"),
    },
    "deepspeed.runtime.zero": _callables(ZERO3, "ZeroParamType", "register_external_parameter",
                                         "DeepSpeedZeRoOffload", "DeepSpeedTensorOverride", "TiledLinear",
                                         "TiledLinearReturnBias", "unwrap_model_for_generation"),
    "deepspeed.comm": {
        **_values(COMM_BACKEND, "cdb", "nccl_backend", "mpi_backend", "ccl_backend", "hccl_backend"),
        **_callables(COMM_BACKEND, "ProcessGroup", "init_deepspeed_backend", "set_backend"),
        **_values(COMMS_LOGGER, "timers", "timer_summary", "comms_logger"),
        **_callables(COMMS_LOGGER, "timed_op", "reset_log", "has_comm_data", "get_comm_operation_count",
                     "get_logged_comm_ops", "get_default_args", "get_tensor_position", "get_tensor_kwarg",
                     "get_msg_size_from_args", "get_debug_log_name"),
        **_callables(COLLECTIVE, "reduce_scatter_fn", "allgather_fn", "all_to_all", "send",
                     "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "gather", "scatter", "reduce_scatter",
                     "has_all_reduce_coalesced", "has_coalescing_manager", "all_gather_coalesced",
                     "inference_all_reduce", "all_reduce_coalesced", "enable_symm_mem_for_group"),
        **_callables(TENSOR_PARALLEL, "initialize_mesh_device"),
        **_callables(LAUNCHER_ENV, "mpi_discovery", "in_aml", "in_aws_sm", "in_dlts",
                     "patch_aml_env_for_torch_nccl_backend", "patch_aws_sm_env_for_torch_nccl_backend",
                     "get_local_rank_from_launcher", "get_world_rank_from_launcher", "get_world_size_from_launcher"),
        **_values(COMM_BACKEND, *(name for name in _COMM_CONSTANTS if name.endswith("_BACKEND"))),
        **_values(COMMS_LOGGER, *(name for name in _COMM_CONSTANTS if name.startswith("COMMS_LOGGER"))),
        **_values(LAUNCHER_ENV, "DEFAULT_AML_MASTER_PORT", "DEFAULT_AML_NCCL_SOCKET_IFNAME"),
    },
    "deepspeed.runtime.sequence_parallel.ulysses_sp": _callables(
        SEQUENCE_PARALLEL, "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "SequenceTiledCompute", "TiledMLP",
        "TiledFusedLogitsLoss"),
    "deepspeed.checkpoint": {
        **_callables(UNIVERSAL_CHECKPOINT, "reshape_meg_2d_parallel", "DeepSpeedCheckpoint",
                     "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank",
                     "merge_state", "model_3d_desc", "get_model_3d_descriptor", "ZeROCheckpoint",
                     "enable_universal_checkpoint", "SubparamShape"),
        **_values(UNIVERSAL_CHECKPOINT, *_CHECKPOINT_CONSTANTS),
    },
}


def message(module: str, name: str) -> str:
    """What a use of `module.name` reports."""
    advice = NOT_PROVIDED[module][name].advice
    return f"{module}.{name} is not provided by this fork (upstream DeepSpeed has it): {advice}"


class _StandInType(type):
    """Metaclass of the stand-in for an upstream class, function or module: calling it or reading one of its
    attributes raises. It stays a real class, so `isinstance(x, FusedAdam)` is simply False."""

    _message: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotProvidedError(cls._message)

    def __getattr__(cls, attr: str) -> Any:
        # Reached only for attributes the class lacks. Introspection (inspect, copy, pytest) probes optional
        # dunders, which must stay plain misses.
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        raise NotProvidedAttributeError(cls._message)

    def __repr__(cls) -> str:
        return f"<not provided by this fork: {cls.__module__}.{cls.__qualname__}>"


class _StandInValue:
    """Stand-in for an upstream constant or module state: any use of its value raises (repr does not, so that
    debuggers and logs can show it)."""

    __slots__ = ("_name", "_message")

    def __init__(self, name: str, text: str) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_message", text)

    def __repr__(self) -> str:
        return f"<not provided by this fork: {self._name}>"

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise NotProvidedError(self._message)

    __bool__ = __str__ = __format__ = __hash__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _fail
    __len__ = __iter__ = __contains__ = __getitem__ = __call__ = __int__ = __float__ = __index__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __mod__ = __or__ = _fail
    __setattr__ = _fail

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        raise NotProvidedAttributeError(self._message)


_stand_ins: dict[tuple[str, str], Any] = {}


def stand_in(module: str, name: str) -> Any:
    """The (one, cached) stand-in for `module.name`, a row of NOT_PROVIDED."""
    key = (module, name)
    if key not in _stand_ins:
        text = message(module, name)
        if NOT_PROVIDED[module][name].is_value:
            _stand_ins[key] = _StandInValue(f"{module}.{name}", text)
        else:
            _stand_ins[key] = _StandInType(name, (), {"__module__": module, "__qualname__": name, "__doc__": text,
                                                      "_message": text})
    return _stand_ins[key]


def is_stand_in(obj: Any) -> bool:
    """True for a stand-in returned by a package's `__getattr__` (not a real implementation)."""
    return isinstance(obj, (_StandInType, _StandInValue))


def module_getattr(module: str) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `module` that answers its NOT_PROVIDED names with stand-ins."""
    missing = NOT_PROVIDED[module]

    def __getattr__(name: str) -> Any:
        if name in missing:
            return stand_in(module, name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
