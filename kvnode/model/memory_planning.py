"""How many KV blocks the pool gets, decided once, after the weights are loaded.

Exactly one source decides (first given wins):

1. ``num_gpu_blocks``: that many blocks.
2. ``kv_cache_memory``: that many bytes for K and V of all layers.
3. ``gpu_memory_utilization``: a fraction of device memory. On CUDA it is the fraction of the
   device's total memory this process may use, weights included (vLLM's meaning). A profile
   forward pass of ``max_num_batched_tokens`` tokens measures the activation peak
   (``reset_peak_memory_stats`` / ``max_memory_allocated``), and the pool gets
   ``total * fraction - weights - activation peak - non-torch memory - copy staging``
   (`cuda_kv_budget`; non-torch: the CUDA context, library workspaces, what other processes
   hold; copy staging: the tiers' device buffer, `copy_staging_bytes`), at most the memory
   free after the profile. On CPU it is a fraction of ``MemAvailable`` from
   ``/proc/meminfo``, read after the weights are loaded (so the weights are already
   excluded).
4. Nothing given: on CUDA, ``gpu_memory_utilization = 0.9``; on CPU ``0.1 × MemAvailable``
   capped at ``DEFAULT_CPU_KV_CAP_BYTES`` (1 GiB) — the CPU pool is zero-filled up front and
   shares the host with everything else, so it stays modest unless asked for.

The pool must hold at least one request of ``max_model_len`` tokens; otherwise start-up fails
with a ValueError that names the numbers and what to change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_CPU_KV_FRACTION = 0.1
DEFAULT_CPU_KV_CAP_BYTES = 1 * GiB
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# The tiers' device staging tensor (kvnode.engine.block_transfer): big enough that one chunk
# of a batched copy runs near the link's speed, small next to the pool.
COPY_STAGING_BYTES = 64 << 20


def copy_staging_bytes(block_bytes: int) -> int:
    """Bytes of the copy staging tensor: whole blocks, at least one."""
    return max(1, COPY_STAGING_BYTES // block_bytes) * block_bytes


@dataclass(frozen=True, slots=True)
class CudaMemoryProfile:
    """What the start-up profile measured on the device, in bytes."""

    total: int
    free: int  # free after the profile, the scratch pool released
    weights: int  # torch memory allocated before the profile: weights and buffers
    activation_peak: int  # the profile forward's peak above that (scratch KV excluded)
    non_torch: int  # the device's used memory that torch's allocator does not hold
    reserved: int = 0  # set aside for the tiers' copy staging tensor


def cuda_kv_budget(profile: CudaMemoryProfile, utilization: float) -> int:
    """The pool's bytes, as vLLM sizes it: the share of the device this process may use,
    less everything else it needs; never more than is free (other processes may hold memory
    the share assumed)."""
    p = profile
    budget = (int(p.total * utilization) - p.weights - p.activation_peak - p.non_torch
              - p.reserved)
    if budget > p.free - p.reserved:
        logger.warning(
            "gpu_memory_utilization=%.2f asks for %.2f GiB of KV cache but only %.2f GiB are "
            "free: using what is free", utilization, budget / GiB, (p.free - p.reserved) / GiB)
        budget = p.free - p.reserved
    return max(0, budget)


def measure_cuda_memory(device: torch.device, weights: int, activation_peak: int,
                        reserved: int) -> CudaMemoryProfile:
    """The device's totals now (call after the profile, with torch's cache emptied)."""
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    return CudaMemoryProfile(total, free, weights, activation_peak, non_torch, reserved)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    num_blocks: int
    block_size: int
    block_bytes: int
    max_model_len: int
    source: str  # which setting decided
    profile: CudaMemoryProfile | None = None  # the CUDA measurement, where one decided

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def blocks_per_request(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """How many requests of ``max_model_len`` tokens fit at once (block granularity)."""
        return self.num_blocks / self.blocks_per_request


def cpu_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int:
    """``MemAvailable`` in bytes (falls back on ``MemFree``)."""
    fields: dict[str, int] = {}
    for line in Path(meminfo).read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            fields[key] = int(parts[0]) * 1024  # values are in kB
    for key in ("MemAvailable", "MemFree"):
        if key in fields:
            return fields[key]
    raise RuntimeError(f"cannot read available memory from {meminfo}")


def plan_kv_cache(
    *,
    block_size: int,
    block_bytes: int,
    max_model_len: int,
    device: torch.device | str,
    num_gpu_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float | None = None,
    profile: Callable[[], CudaMemoryProfile] | None = None,
) -> MemoryPlan:
    """Decide the pool size, log it, and reject a pool that cannot hold one full request.

    `profile` measures the device (on CUDA; called only when the utilization decides)."""
    if block_bytes <= 0 or block_size <= 0 or max_model_len <= 0:
        raise ValueError("block_size, block_bytes and max_model_len must be positive")
    dev = torch.device(device)
    if num_gpu_blocks is not None:
        if num_gpu_blocks < 0:
            raise ValueError(f"num_gpu_blocks must be >= 0, got {num_gpu_blocks}")
        num_blocks, source = int(num_gpu_blocks), f"num_gpu_blocks={num_gpu_blocks}"
        measured = None
    else:
        budget, source, measured = _kv_budget_bytes(dev, kv_cache_memory,
                                                    gpu_memory_utilization, profile)
        num_blocks = max(0, budget // block_bytes)
    plan = MemoryPlan(num_blocks, block_size, block_bytes, max_model_len, source, measured)
    logger.info("KV cache size: %d tokens", plan.num_tokens)
    logger.info(
        "Maximum concurrency for %d tokens per request: %.2fx",
        max_model_len, plan.max_concurrency,
    )
    if plan.num_blocks < plan.blocks_per_request:
        raise ValueError(
            f"KV cache too small: {plan.num_blocks} blocks of {block_size} tokens "
            f"({plan.num_tokens} tokens, {plan.kv_cache_bytes} bytes, from {source}) cannot hold "
            f"one request of max_model_len={max_model_len} tokens, which needs "
            f"{plan.blocks_per_request} blocks ({plan.blocks_per_request * block_bytes} bytes). "
            f"Increase kv_cache_memory / num_gpu_blocks / gpu_memory_utilization, or lower "
            f"max_model_len."
        )
    return plan


def _kv_budget_bytes(
    dev: torch.device, kv_cache_memory: int | None, utilization: float | None,
    profile: Callable[[], CudaMemoryProfile] | None,
) -> tuple[int, str, CudaMemoryProfile | None]:
    if kv_cache_memory is not None:
        if kv_cache_memory < 0:
            raise ValueError(f"kv_cache_memory must be >= 0, got {kv_cache_memory}")
        return int(kv_cache_memory), f"kv_cache_memory={kv_cache_memory}", None
    if utilization is not None and not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if dev.type == "cuda":
        frac = DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization
        if profile is None:  # no forward to profile: what is allocated now stands for it
            measured = measure_cuda_memory(dev, torch.cuda.memory_allocated(dev), 0, 0)
        else:
            measured = profile()
        budget = cuda_kv_budget(measured, frac)
        logger.info(
            "Memory profiling: %.2f GiB x %.2f = %.2f GiB for this process; weights %.2f GiB, "
            "activation peak %.2f GiB, non-torch %.2f GiB, copy staging %.2f GiB; "
            "KV cache %.2f GiB", measured.total / GiB, frac, measured.total * frac / GiB,
            measured.weights / GiB, measured.activation_peak / GiB, measured.non_torch / GiB,
            measured.reserved / GiB, budget / GiB)
        return budget, f"gpu_memory_utilization={frac}", measured
    available = cpu_available_bytes()
    if utilization is not None:
        return int(available * utilization), (
            f"gpu_memory_utilization={utilization} of MemAvailable"
        ), None
    budget = min(int(available * DEFAULT_CPU_KV_FRACTION), DEFAULT_CPU_KV_CAP_BYTES)
    return budget, "CPU default (0.1 x MemAvailable, at most 1 GiB)", None
