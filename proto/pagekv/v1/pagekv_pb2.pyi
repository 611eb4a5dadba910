from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop_token_ids", "ignore_eos", "stop", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "min_p", "prompt_logprobs", "skip_special_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    n: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    min_p: float
    prompt_logprobs: int
    skip_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., min_p: _Optional[float] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "cache_salt", "lora_id", "kv_source", "handover", "cache_control", "one_shot", "session_id", "tenant", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    CACHE_CONTROL_FIELD_NUMBER: _ClassVar[int]
    ONE_SHOT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    cache_salt: str
    lora_id: int
    kv_source: KvSource
    handover: Handover
    cache_control: CacheControl
    one_shot: bool
    session_id: str
    tenant: str
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora_id: _Optional[int] = ..., kv_source: _Optional[_Union[KvSource, _Mapping]] = ..., handover: _Optional[_Union[Handover, _Mapping]] = ..., cache_control: _Optional[_Union[CacheControl, _Mapping]] = ..., one_shot: _Optional[bool] = ..., session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class CacheControl(_message.Message):
    __slots__ = ("ttl_s", "tokens")
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ttl_s: int
    tokens: int
    def __init__(self, ttl_s: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class Handover(_message.Message):
    __slots__ = ("hold_ms",)
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    hold_ms: int
    def __init__(self, hold_ms: _Optional[int] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("pod_id", "address", "num_blocks", "handover_id")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    address: str
    num_blocks: int
    handover_id: str
    def __init__(self, pod_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., handover_id: _Optional[str] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: Logprob
    top: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, sampled: _Optional[_Union[Logprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finish_reason", "logprobs", "stop_string", "stop_token_id", "prompt_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    stop_string: str
    stop_token_id: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "cached_tokens_gpu", "cached_tokens_cpu", "cached_tokens_disk", "cached_tokens_peer", "kv_pull_ms", "kv_pull_fallback")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_GPU_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_CPU_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_DISK_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_PEER_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_gpu: int
    cached_tokens_cpu: int
    cached_tokens_disk: int
    cached_tokens_peer: int
    kv_pull_ms: float
    kv_pull_fallback: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_tokens_gpu: _Optional[int] = ..., cached_tokens_cpu: _Optional[int] = ..., cached_tokens_disk: _Optional[int] = ..., cached_tokens_peer: _Optional[int] = ..., kv_pull_ms: _Optional[float] = ..., kv_pull_fallback: _Optional[str] = ...) -> None: ...

class CandidateScore(_message.Message):
    __slots__ = ("pod_id", "address", "cached_tokens", "cached_tokens_gpu", "cached_tokens_cpu", "cached_tokens_disk", "queue_waiting", "queue_running", "estimated_cost_s", "eligible", "excluded_reason", "pull_from", "pull_tokens", "pull_saving_s")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_GPU_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_CPU_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_DISK_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_COST_S_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_REASON_FIELD_NUMBER: _ClassVar[int]
    PULL_FROM_FIELD_NUMBER: _ClassVar[int]
    PULL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULL_SAVING_S_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    address: str
    cached_tokens: int
    cached_tokens_gpu: int
    cached_tokens_cpu: int
    cached_tokens_disk: int
    queue_waiting: int
    queue_running: int
    estimated_cost_s: float
    eligible: bool
    excluded_reason: str
    pull_from: str
    pull_tokens: int
    pull_saving_s: float
    def __init__(self, pod_id: _Optional[str] = ..., address: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., cached_tokens_gpu: _Optional[int] = ..., cached_tokens_cpu: _Optional[int] = ..., cached_tokens_disk: _Optional[int] = ..., queue_waiting: _Optional[int] = ..., queue_running: _Optional[int] = ..., estimated_cost_s: _Optional[float] = ..., eligible: _Optional[bool] = ..., excluded_reason: _Optional[str] = ..., pull_from: _Optional[str] = ..., pull_tokens: _Optional[int] = ..., pull_saving_s: _Optional[float] = ...) -> None: ...

class RoutingInfo(_message.Message):
    __slots__ = ("chosen_pod", "chosen_address", "reason", "predicted_cached_tokens", "prompt_blocks", "lookup_ms", "candidates", "pull_from", "pull_tokens", "predicted_pull_saving_s", "prefill_pod", "prefill_address", "prefill_ms", "handover_ms", "handover_tokens", "pd_fallback", "pd_threshold_tokens")
    CHOSEN_POD_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    PULL_FROM_FIELD_NUMBER: _ClassVar[int]
    PULL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PULL_SAVING_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_POD_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PD_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    PD_THRESHOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    chosen_pod: str
    chosen_address: str
    reason: str
    predicted_cached_tokens: int
    prompt_blocks: int
    lookup_ms: float
    candidates: _containers.RepeatedCompositeFieldContainer[CandidateScore]
    pull_from: str
    pull_tokens: int
    predicted_pull_saving_s: float
    prefill_pod: str
    prefill_address: str
    prefill_ms: float
    handover_ms: float
    handover_tokens: int
    pd_fallback: str
    pd_threshold_tokens: int
    def __init__(self, chosen_pod: _Optional[str] = ..., chosen_address: _Optional[str] = ..., reason: _Optional[str] = ..., predicted_cached_tokens: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., lookup_ms: _Optional[float] = ..., candidates: _Optional[_Iterable[_Union[CandidateScore, _Mapping]]] = ..., pull_from: _Optional[str] = ..., pull_tokens: _Optional[int] = ..., predicted_pull_saving_s: _Optional[float] = ..., prefill_pod: _Optional[str] = ..., prefill_address: _Optional[str] = ..., prefill_ms: _Optional[float] = ..., handover_ms: _Optional[float] = ..., handover_tokens: _Optional[int] = ..., pd_fallback: _Optional[str] = ..., pd_threshold_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "completions", "usage", "served_by", "routing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    usage: Usage
    served_by: str
    routing: RoutingInfo
    def __init__(self, request_id: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., served_by: _Optional[str] = ..., routing: _Optional[_Union[RoutingInfo, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "finish_reason", "usage", "served_by", "routing", "logprobs", "stop_string", "stop_token_id", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    served_by: str
    routing: RoutingInfo
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    stop_string: str
    stop_token_id: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., served_by: _Optional[str] = ..., routing: _Optional[_Union[RoutingInfo, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "used_bytes", "capacity_bytes", "entries")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    used_bytes: int
    capacity_bytes: int
    entries: int
    def __init__(self, tier: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., entries: _Optional[int] = ...) -> None: ...

class HashConfig(_message.Message):
    __slots__ = ("algo", "seed_fingerprint", "block_size", "namespace")
    ALGO_FIELD_NUMBER: _ClassVar[int]
    SEED_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    algo: str
    seed_fingerprint: str
    block_size: int
    namespace: str
    def __init__(self, algo: _Optional[str] = ..., seed_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., namespace: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pod_id", "model", "block_size", "num_blocks", "num_free_blocks", "usage", "tiers", "num_waiting", "num_running", "hash_config", "epoch", "role", "handover_held_blocks")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    HASH_CONFIG_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    model: str
    block_size: int
    num_blocks: int
    num_free_blocks: int
    usage: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    num_waiting: int
    num_running: int
    hash_config: HashConfig
    epoch: str
    role: str
    handover_held_blocks: int
    def __init__(self, pod_id: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., hash_config: _Optional[_Union[HashConfig, _Mapping]] = ..., epoch: _Optional[str] = ..., role: _Optional[str] = ..., handover_held_blocks: _Optional[int] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "hash_config", "kv_layout", "max_bytes", "request_id", "chain_token_ids", "cache_salt", "lora_id", "transports", "handover_id")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    HASH_CONFIG_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHAIN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    hash_config: HashConfig
    kv_layout: str
    max_bytes: int
    request_id: str
    chain_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    lora_id: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    handover_id: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., hash_config: _Optional[_Union[HashConfig, _Mapping]] = ..., kv_layout: _Optional[str] = ..., max_bytes: _Optional[int] = ..., request_id: _Optional[str] = ..., chain_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., lora_id: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., handover_id: _Optional[str] = ...) -> None: ...

class PullBlocksChunk(_message.Message):
    __slots__ = ("entries", "ticket", "ready_blocks")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedScalarFieldContainer[bytes]
    ticket: TransferTicket
    ready_blocks: int
    def __init__(self, entries: _Optional[_Iterable[bytes]] = ..., ticket: _Optional[_Union[TransferTicket, _Mapping]] = ..., ready_blocks: _Optional[int] = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("transport", "token", "num_blocks", "port", "session", "buffer", "entry_lengths")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    ENTRY_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    token: bytes
    num_blocks: int
    port: int
    session: str
    buffer: int
    entry_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transport: _Optional[str] = ..., token: _Optional[bytes] = ..., num_blocks: _Optional[int] = ..., port: _Optional[int] = ..., session: _Optional[str] = ..., buffer: _Optional[int] = ..., entry_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("include_tiers",)
    INCLUDE_TIERS_FIELD_NUMBER: _ClassVar[int]
    include_tiers: bool
    def __init__(self, include_tiers: _Optional[bool] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("success", "message", "blocks_cleared")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    blocks_cleared: int
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ..., blocks_cleared: _Optional[int] = ...) -> None: ...

class PrefixQuery(_message.Message):
    __slots__ = ("text", "token_ids", "block_hashes", "prefix_hash", "cache_salt")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    block_hashes: BlockHashes
    prefix_hash: bytes
    cache_salt: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., block_hashes: _Optional[_Union[BlockHashes, _Mapping]] = ..., prefix_hash: _Optional[bytes] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class BlockHashes(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PodHolding(_message.Message):
    __slots__ = ("pod_id", "prefix_blocks", "gpu_blocks", "cpu_blocks", "disk_blocks", "pinned_blocks", "error")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    prefix_blocks: int
    gpu_blocks: int
    cpu_blocks: int
    disk_blocks: int
    pinned_blocks: int
    error: str
    def __init__(self, pod_id: _Optional[str] = ..., prefix_blocks: _Optional[int] = ..., gpu_blocks: _Optional[int] = ..., cpu_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PrefixHoldings(_message.Message):
    __slots__ = ("pods", "total_blocks")
    PODS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pods: _containers.RepeatedCompositeFieldContainer[PodHolding]
    total_blocks: int
    def __init__(self, pods: _Optional[_Iterable[_Union[PodHolding, _Mapping]]] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class PrewarmRequest(_message.Message):
    __slots__ = ("text", "token_ids", "cache_salt", "pod_id", "kv_source", "cache_control", "tenant")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CACHE_CONTROL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    cache_salt: str
    pod_id: str
    kv_source: KvSource
    cache_control: CacheControl
    tenant: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., cache_salt: _Optional[str] = ..., pod_id: _Optional[str] = ..., kv_source: _Optional[_Union[KvSource, _Mapping]] = ..., cache_control: _Optional[_Union[CacheControl, _Mapping]] = ..., tenant: _Optional[str] = ...) -> None: ...

class HotPrefixesRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class HotPrefix(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "lora_id", "tenant", "hits", "pod_id", "prefix_hash")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    token_ids: TokenIds
    cache_salt: str
    lora_id: str
    tenant: str
    hits: int
    pod_id: str
    prefix_hash: bytes
    def __init__(self, token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora_id: _Optional[str] = ..., tenant: _Optional[str] = ..., hits: _Optional[int] = ..., pod_id: _Optional[str] = ..., prefix_hash: _Optional[bytes] = ...) -> None: ...

class HotPrefixesResponse(_message.Message):
    __slots__ = ("prefixes",)
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    prefixes: _containers.RepeatedCompositeFieldContainer[HotPrefix]
    def __init__(self, prefixes: _Optional[_Iterable[_Union[HotPrefix, _Mapping]]] = ...) -> None: ...

class PrewarmResponse(_message.Message):
    __slots__ = ("pod_id", "prompt_tokens", "cached_tokens", "pulled_tokens", "computed_tokens", "source", "seconds")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    prompt_tokens: int
    cached_tokens: int
    pulled_tokens: int
    computed_tokens: int
    source: str
    seconds: float
    def __init__(self, pod_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., pulled_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., source: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
