"""Every engine option in one place: the LLM keywords and the CLI flags are built from it."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class EngineArgs:
    model: str = "pagekv-tiny"
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    hash_seed: str = "vllm-none-hash"
    max_model_len: int | None = None
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_n: int = 16  # largest n (parallel samples) a request may ask for
    watermark: float = 0.01
    device: str | None = None
    attention_backend: str | None = None
    # Offload tiers below the pool (0 = off).
    cpu_offload_bytes: int = 0
    disk_offload_bytes: int = 0
    disk_offload_dir: str | None = None
    block_metrics_sample_rate: float = 0.01

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
