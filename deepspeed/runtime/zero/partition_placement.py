"""Where a rank's lp partitions live at ZeRO stage 3: the one place that decides it.

Without `zero_optimization.offload_param` the partitions live on the accelerator, beside the computation that uses
them. With `offload_param: {"device": "cpu"}` they live in host memory (page-locked when `pin_memory` is set and
there is an accelerator to copy to), and a unit's parameters are fetched from there into its gather buffer on the
accelerator for its forward and backward, then released. Parameter offload is a policy over the same gather and
release (param_residency.py): the gather's pack copy reads host memory instead of device memory, and the partition
is never used in place by the computation.

On a CPU-only run the accelerator is the host: the offloaded partitions are still separate host tensors, fetched
into gather buffers and released as on a GPU (ordinary copies, no streams), which is what CPU tests observe.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from deepspeed.runtime.pinned_memory import zeros_pinned


@dataclass(frozen=True)
class PartitionPlacement:
    """Where the lp partitions are stored and where their parameters are used.

    Attributes:
        compute_device: the accelerator device that runs the forward and backward (gather buffers live here).
        is_offloaded: the partitions live in host memory (`offload_param` device "cpu").
        pin_memory: host partitions are page-locked (only when offloaded and the compute device is an accelerator).
    """

    compute_device: torch.device
    is_offloaded: bool = False
    pin_memory: bool = False

    @classmethod
    def from_config(cls, compute_device: torch.device, offload_param: Optional[object]) -> "PartitionPlacement":
        """The placement a `zero_optimization.offload_param` section (or None) asks for.

        Raises:
            ValueError: a device other than "none" or "cpu" (NVMe needs upstream's asynchronous I/O op).
        """
        device = getattr(getattr(offload_param, "device", None), "value", getattr(offload_param, "device", None))
        if offload_param is None or device in (None, "none"):
            return cls(compute_device)
        if device != "cpu":
            raise ValueError(f"zero_optimization.offload_param.device '{device}' is not implemented in this fork: "
                             "NVMe offload needs upstream's asynchronous I/O op, which is not built here; use 'cpu' "
                             "(parameter partitions in host memory) or 'none'")
        pin = bool(getattr(offload_param, "pin_memory", False)) and compute_device.type != "cpu"
        return cls(compute_device, is_offloaded=True, pin_memory=pin)

    @property
    def storage_device(self) -> torch.device:
        """Where the lp partitions are allocated."""
        return torch.device("cpu") if self.is_offloaded else self.compute_device

    @property
    def uses_partitions_in_place(self) -> bool:
        """Whether the computation may read a partition directly (one rank: the partition holds every parameter
        whole). Never for host partitions: the forward runs on the accelerator, and a fetched copy is what gets
        released after use."""
        return not self.is_offloaded

    @property
    def non_blocking(self) -> bool:
        """Copies from the host partitions may run asynchronously (page-locked memory only)."""
        return self.pin_memory

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled partition of `numel` elements where partitions live."""
        if self.pin_memory:
            return zeros_pinned(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=self.storage_device)
