"""Large page-locked host buffers are exactly the size asked for (torch's caching host allocator would round a
buffer up to the next power of two), copy asynchronously, and go back to the system when their tensor goes."""

import gc

import pytest
import torch

from deepspeed.runtime.pinned_memory import EXACT_PIN_MIN_BYTES, empty_pinned, zeros_pinned

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs the CUDA driver")


@needs_cuda
def test_a_large_buffer_is_pinned_at_its_exact_size_and_round_trips():
    numel = (EXACT_PIN_MIN_BYTES * 3 // 2) // 4 + 1  # 1.5x the threshold: torch would pin 2x
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    host = zeros_pinned(numel, torch.float32)
    assert host.is_pinned() and host.untyped_storage().nbytes() == numel * 4
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before  # not the caching allocator
    assert torch.count_nonzero(host) == 0
    source = torch.arange(numel, dtype=torch.float32, device="cuda")
    host.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, source.cpu())


@needs_cuda
def test_the_registration_goes_with_the_tensor():
    host = empty_pinned(EXACT_PIN_MIN_BYTES // 2 + 1, torch.int16)
    nbytes = host.untyped_storage().nbytes()
    cudart = torch.cuda.cudart()
    del host
    gc.collect()
    # Memory still registered cannot be registered again: the allocator hands the freed pages (usually the same
    # address) to the next tensor of that size, which registers only if the first registration went.
    again = torch.empty(nbytes, dtype=torch.uint8)
    assert int(cudart.cudaHostRegister(again.data_ptr(), nbytes, 0)) == 0
    assert int(cudart.cudaHostUnregister(again.data_ptr())) == 0


def test_small_buffers_and_cpu_only_machines_use_torch_s_own_pinning():
    if not torch.cuda.is_available():
        pytest.skip("torch pins memory only with an accelerator")
    small = empty_pinned(16, torch.float32)
    assert small.is_pinned()
