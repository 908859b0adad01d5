"""Config names and value sets shared by the config parser, the optimizer factory and the engine.

Key defaults live on the pydantic fields (config.py, precision_config.py, zero/config.py), not here.
"""

# optimizer.type: DeepSpeed's own names are matched case-insensitively and lower-cased ("sgd" is
# torch.optim.SGD); any other name must be a torch.optim optimizer class, spelled exactly.
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
MUON_OPTIMIZER = "muon"
SGD_OPTIMIZER = "sgd"
DEEPSPEED_OPTIMIZERS = (ADAM_OPTIMIZER, ADAMW_OPTIMIZER, MUON_OPTIMIZER, SGD_OPTIMIZER)

# optimizer.params keys that DeepSpeed consumes itself for adam/adamw.
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True
MAX_GRAD_NORM = "max_grad_norm"

# Muon's value sets (optimizer.params); deepspeed/runtime/optimizer_params.py holds the rules for every key.
MUON_NS_METHODS = ("standard", "gram", "gram_sym", "auto")
# Newton-Schulz coefficient schedules (deepspeed/runtime/zero/muon/math/ns_coefficients.py).
MUON_NS_COEFFICIENTS = ("jordan", "polar_express")
MUON_NS_DTYPES = ("fp32", "bf16", "fp16")
# The dtypes Muon's momentum may be kept in (optimizer.params.momentum_dtype).
MUON_MOMENTUM_DTYPES = ("fp32", "bf16")
MUON_ADJUST_LR_FNS = ("original", "match_rms_adamw")
# Which parameters Muon takes (optimizer.params.param_split; deepspeed/runtime/zero/muon/param_split.py).
MUON_PARAM_SPLITS = ("hidden", "upstream")

# scheduler.type: deepspeed.runtime.lr_schedules classes (exact spelling); else torch.optim.lr_scheduler.
DEEPSPEED_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

GRADIENT_ALLREDUCE_OPS = ["mean", "sum"]
COMMUNICATION_DATA_TYPES = ["fp16", "bf16", "fp32"]
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
CHECKPOINT_TAG_VALIDATION_MODES = ["WARN", "IGNORE", "FAIL"]

# Spellings accepted for data_types.* (upstream's aliases), mapped to the canonical name.
DTYPE_ALIASES = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "bfloat": "bf16",
    "torch.bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}

# Keys of the dynamic loss-scale dict handed to CreateLossScaler (upstream's names).
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"

# Legacy `"zero_optimization": true` takes its all-gather bucket size from this top-level key.
ALLGATHER_SIZE = "allgather_size"
ALLGATHER_SIZE_DEFAULT = 500_000_000

