"""The benchmarked training set-ups ("modes") and one runner per kind.

A runner owns a freshly built model and optimizer and exposes the two halves of a training step:
`forward_backward()` (every micro-batch, up to the last backward) and `optimizer_step()` (everything
after it: for our engine `engine.step()` at the accumulation boundary; for the DDP reference gradient
clipping, the optimizers' steps and zero_grad). The benchmark times the halves separately.

A mode runs in a tree: this checkout ("this") or an upstream release ("0.19.8") imported in its own processes.
For a release, only its public surface is used (`deepspeed.initialize`, the engine's forward/backward/step, the
JSON config keys it reads); the DDP reference does not depend on the tree and runs in this checkout only.
"""

import contextlib
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel

import deepspeed

from gpt_model import GPT, GPTConfig, is_hidden_matrix

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-10
THIS_TREE = "this"
# What upstream releases fix: the Newton-Schulz steps their Muon always runs (their config has no ns_steps).
UPSTREAM_NS_STEPS = 5
# The profiler range around the DDP runner's gradient clipping (torch's optimizers open their own per step).
DDP_CLIP_RANGE = "bench.clip_grad_norm"


@dataclass(frozen=True)
class Mode:
    """One row of the table.

    Attributes:
        name: e.g. "ds-z2-bf16-muon".
        backend: "deepspeed" (our engine) or "ddp" (torch DDP, no DeepSpeed).
        stage: ZeRO stage (deepspeed only).
        dtype: "bf16" or "fp16" (DDP: bf16 autocast over fp32 weights).
        optimizer: "muon" (Muon for hidden matrices, AdamW for the rest) or "adamw".
        tree: the code it runs: "this" checkout or an upstream release such as "0.19.8".
        muon_options: extra Muon config params of a variant, as (key, value) pairs (this checkout only).
    """

    name: str
    backend: str
    stage: Optional[int]
    dtype: str
    optimizer: str
    tree: str = THIS_TREE
    muon_options: tuple = ()

    @property
    def label(self) -> str:
        """The name in the results: "ds-z2-bf16-muon" here, "ds-z2-bf16-muon@0.19.8" in a release."""
        return self.name if self.tree == THIS_TREE else f"{self.name}@{self.tree}"

    def in_tree(self, tree: str) -> "Mode":
        return replace(self, tree=tree)


def _ds(stage: int, dtype: str, optimizer: str) -> Mode:
    return Mode(f"ds-z{stage}-{dtype}-{optimizer}", "deepspeed", stage, dtype, optimizer)


# Target rows first: if a run is cut short, the rows the targets need are already measured.
ALL_MODES = [
    _ds(2, "bf16", "muon"),
    _ds(2, "bf16", "adamw"),
    Mode("ddp-bf16-muon", "ddp", None, "bf16", "muon"),
    Mode("ddp-bf16-adamw", "ddp", None, "bf16", "adamw"),
    _ds(1, "bf16", "muon"),
    _ds(1, "bf16", "adamw"),
    _ds(2, "fp16", "muon"),
    _ds(2, "fp16", "adamw"),
    _ds(1, "fp16", "muon"),
    _ds(1, "fp16", "adamw"),
]
# ZeRO-3 (parameters partitioned, gathered around each module's use): selected by name, not in the default table.
EXTRA_MODES = [_ds(3, "bf16", "muon"), _ds(3, "bf16", "adamw")]
# Muon's variants beside the default (docs/muon.md): selected by name.
VARIANT_MODES = [
    Mode("ds-z2-bf16-muon-polar-express", "deepspeed", 2, "bf16", "muon",
         muon_options=(("ns_coefficients", "polar_express"), )),
    Mode("ds-z2-bf16-muon-normuon", "deepspeed", 2, "bf16", "muon", muon_options=(("normuon", True), )),
    Mode("ds-z2-bf16-muon-bf16-momentum", "deepspeed", 2, "bf16", "muon", muon_options=(("momentum_dtype", "bf16"), )),
]
EXTRA_MODES += VARIANT_MODES
MODES_BY_NAME = {mode.name: mode for mode in ALL_MODES + EXTRA_MODES}


@dataclass(frozen=True)
class Settings:
    """Model size, batch and optimizer hyper-parameters shared by every mode."""

    model: GPTConfig
    micro_batch: int
    grad_accum: int
    clip: float
    muon_lr: float
    adam_lr: float
    momentum: float
    ns_method: str
    ns_steps: int
    ns_dtype: Optional[str]
    overlap_comm: bool
    bucket_size: int
    fused_adamw: bool
    seed: int
    ns_cuda_graph: Optional[bool] = None  # None: the engine's default


def init_rank_device() -> tuple:
    """Initialise the process group (deepspeed.comm, either tree) and this rank's device.

    Returns (rank, world size, device): the CPU on a CPU accelerator, else the local rank's accelerator device.
    """
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed()
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        device = torch.device("cpu")
    else:
        accelerator.set_device(dist.get_local_rank())
        device = torch.device(accelerator.device_name(dist.get_local_rank()))
    return dist.get_rank(), dist.get_world_size(), device


def build_model(settings: Settings, device: torch.device) -> GPT:
    """The fp32 model, initialised from the seed directly on `device` (every mode starts identical)."""
    torch.manual_seed(settings.seed)
    with device:
        return GPT(settings.model)


def make_batches(settings: Settings, device: torch.device, rank: int) -> list:
    """One (inputs, targets) pair of synthetic tokens per micro-batch, different on every rank."""
    generator = torch.Generator().manual_seed(settings.seed + 1000 + rank)
    cfg = settings.model
    batches = []
    for _ in range(settings.grad_accum):
        tokens = torch.randint(cfg.vocab_size, (settings.micro_batch, cfg.seq_len + 1), generator=generator)
        tokens = tokens.to(device)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def upstream_ns_method(ns_method: str) -> str:
    """The ns_method a release is configured with: it knows "standard" and "gram" only, so this fork's per-shape
    and symmetric methods run there as its Gram iteration (the method they are variants of)."""
    return ns_method if ns_method in ("standard", "gram") else "gram"


def deepspeed_config(mode: Mode, settings: Settings) -> dict:
    """The engine's JSON config for `mode`; for a release, only keys that release reads (see `tree_notes`)."""
    upstream = mode.tree != THIS_TREE
    if mode.optimizer == "muon":
        params = {"lr": settings.muon_lr, "muon_lr": settings.muon_lr, "adam_lr": settings.adam_lr,
                  "momentum": settings.momentum, "betas": list(ADAM_BETAS), "eps": ADAM_EPS, "weight_decay": 0.0,
                  "ns_method": settings.ns_method if not upstream else upstream_ns_method(settings.ns_method)}
        if not upstream:
            params |= {"ns_steps": settings.ns_steps, "nesterov": True}
            if settings.ns_dtype is not None:
                params["ns_dtype"] = settings.ns_dtype
            if settings.ns_cuda_graph is not None:
                params["ns_cuda_graph"] = settings.ns_cuda_graph
            params |= dict(mode.muon_options)
        optimizer = {"type": "muon", "params": params}
    else:
        params = {"lr": settings.adam_lr, "betas": list(ADAM_BETAS), "eps": ADAM_EPS, "weight_decay": 0.0}
        if settings.fused_adamw and not upstream:
            params["fused"] = True
        optimizer = {"type": "adamw", "params": params}
    return {
        "train_micro_batch_size_per_gpu": settings.micro_batch,
        "gradient_accumulation_steps": settings.grad_accum,
        "gradient_clipping": settings.clip,
        "steps_per_print": 1_000_000_000,
        "optimizer": optimizer,
        "bf16": {"enabled": mode.dtype == "bf16"},
        "fp16": {"enabled": mode.dtype == "fp16"},
        "zero_optimization": {
            "stage": mode.stage,
            "overlap_comm": settings.overlap_comm,
            "reduce_bucket_size": settings.bucket_size,
            "allgather_bucket_size": settings.bucket_size,
            "reduce_scatter": not (upstream and mode.stage == 3 and mode.optimizer == "muon"),
            "contiguous_gradients": True,
        },
    }


def unsupported_reason(mode: Mode, settings: Settings) -> Optional[str]:
    """Why `mode` cannot run in its tree with these settings (None: it can); recorded instead of a result."""
    if mode.backend == "ddp" and mode.optimizer == "muon" and settings.model.n_experts:
        return ("torch.optim.Muon takes 2-D parameters only; the fused expert weights [experts, out, in] are 3-D")
    if mode.tree == THIS_TREE:
        return None
    if mode.backend == "ddp":
        return "torch DDP does not use DeepSpeed: measured in this checkout's run only"
    if mode.muon_options:
        return f"a Muon variant of this checkout ({dict(mode.muon_options)}): releases have none"
    if mode.optimizer == "muon" and settings.ns_steps != UPSTREAM_NS_STEPS:
        return (f"--ns-steps {settings.ns_steps}: release {mode.tree} always runs {UPSTREAM_NS_STEPS} Newton-Schulz "
                "steps (its config has no ns_steps)")
    return None


def tree_notes(mode: Mode, settings: Settings) -> list:
    """How a release's mode differs from this checkout's in what it is configured to do (empty here)."""
    if mode.tree == THIS_TREE or mode.backend != "deepspeed":
        return []
    notes = []
    if mode.optimizer == "muon":
        method = upstream_ns_method(settings.ns_method)
        notes.append(f"Newton-Schulz: {method} iteration, {UPSTREAM_NS_STEPS} steps, Nesterov momentum "
                     f"and the compute dtype as release {mode.tree} fixes them (its config reads no ns_steps, "
                     "nesterov or ns_dtype)" + (f"; --ns-dtype {settings.ns_dtype} not applied"
                                                if settings.ns_dtype else ""))
        notes.append("Adam half: the release's default Adam (its FusedAdam op, built just in time, where it builds)")
        if mode.stage == 3:
            notes.append("reduce_scatter false: the release refuses Muon at ZeRO stage 3 with reduce_scatter true "
                         "(\"Muon and reduce scatter cannot be used together\")")
    else:
        notes.append("AdamW: the release's default for optimizer type adamw (its FusedAdam op, built just in time); "
                     "this checkout: torch.optim.AdamW" + (" (fused)" if settings.fused_adamw else ""))
    return notes


class DeepSpeedRunner:
    """Our engine: `deepspeed.initialize` with the mode's ZeRO stage, precision and optimizer."""

    def __init__(self, mode: Mode, settings: Settings, device: torch.device, batches: list):
        self.batches = batches
        model = build_model(settings, device)
        self.engine, _, _, _ = deepspeed.initialize(model=model, config=deepspeed_config(mode, settings))

    def forward_backward(self) -> None:
        last = len(self.batches) - 1
        for micro, (inputs, targets) in enumerate(self.batches):
            loss = self.engine(inputs, targets)
            self.engine.backward(loss)
            if micro < last:
                self.engine.step()  # not a boundary: only counts the micro-step

    def optimizer_step(self) -> None:
        self.engine.step()

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def close(self) -> None:
        self.engine.destroy()
        self.engine = None


class ReplicatedMuon(torch.optim.Optimizer):
    """Stand-in for torch.optim.Muon on torch builds without it: every rank orthogonalises every matrix.

    Uses the reference math (`original_muon.muon_update`, standard iteration), as DDP + Muon would. Runs only in
    this checkout (it is the DDP reference), which is why its import waits until a step needs it.
    """

    def __init__(self, params, lr: float, momentum: float, ns_steps: int):
        super().__init__(params, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps})

    @torch.no_grad()
    def step(self, closure=None):
        from deepspeed.runtime.zero.muon.original_muon import muon_update

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                update = muon_update(p.grad, state["momentum_buffer"], beta=group["momentum"],
                                     ns_steps=group["ns_steps"], nesterov=True, ns_method="standard")
                p.add_(update.to(p.dtype), alpha=-group["lr"])


def reference_muon_class() -> str:
    return "torch.optim.Muon" if hasattr(torch.optim, "Muon") else "ReplicatedMuon (original_muon, standard NS)"


class DDPRunner:
    """The reference without DeepSpeed: torch DDP over fp32 weights, bf16 autocast.

    Muon mode: torch.optim.Muon on the hidden matrices (every rank orthogonalises all of them) and fused
    AdamW on the rest; AdamW mode: fused AdamW on everything. Gradients are clipped like the engine's.
    """

    def __init__(self, mode: Mode, settings: Settings, device: torch.device, batches: list):
        self.batches = batches
        self.device = device
        self.clip = settings.clip
        self.model = build_model(settings, device)
        device_ids = [device.index] if device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=device_ids, gradient_as_bucket_view=True)
        named = list(self.model.named_parameters())
        adam_params = [p for _, p in named]
        self.optimizers = []
        if mode.optimizer == "muon":
            hidden = [p for n, p in named if is_hidden_matrix(n, p)]
            adam_params = [p for n, p in named if not is_hidden_matrix(n, p)]
            if hasattr(torch.optim, "Muon"):
                muon = torch.optim.Muon(hidden, lr=settings.muon_lr, momentum=settings.momentum, nesterov=True,
                                        ns_steps=settings.ns_steps, weight_decay=0.0)
            else:
                muon = ReplicatedMuon(hidden, settings.muon_lr, settings.momentum, settings.ns_steps)
            self.optimizers.append(muon)
        self.optimizers.append(torch.optim.AdamW(adam_params, lr=settings.adam_lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                                 weight_decay=0.0, fused=settings.fused_adamw or None))

    def forward_backward(self) -> None:
        scale = 1.0 / len(self.batches)
        last = len(self.batches) - 1
        for micro, (inputs, targets) in enumerate(self.batches):
            context = self.ddp.no_sync() if micro < last else contextlib.nullcontext()
            with context:
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    loss = self.ddp(inputs, targets)
                (loss * scale).backward()

    def optimizer_step(self) -> None:
        if self.clip > 0:
            with torch.profiler.record_function(DDP_CLIP_RANGE):
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        for optimizer in self.optimizers:
            optimizer.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    @property
    def skipped_steps(self) -> int:
        return 0

    def close(self) -> None:
        self.optimizers.clear()
        self.ddp = None
        self.model = None


def build_runner(mode: Mode, settings: Settings, device: torch.device, batches: list):
    runner_class = DeepSpeedRunner if mode.backend == "deepspeed" else DDPRunner
    return runner_class(mode, settings, device, batches)


__all__ = ["ALL_MODES", "MODES_BY_NAME", "THIS_TREE", "Mode", "Settings", "build_runner", "init_rank_device",
           "make_batches",
           "reference_muon_class", "tree_notes", "unsupported_reason"]
