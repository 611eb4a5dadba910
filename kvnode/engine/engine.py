"""The pod's engine: scheduler ▸ KV cache manager ▸ model runner, one step at a time.

`step()` schedules, applies queued copy-on-write block copies, runs one forward pass over the
mixed batch, samples, and returns what each request produced in that step (deltas). Requests
with n > 1 prefill their prompt once; the children are forked from it right after, sharing
every block, each with its own sampling generator. A request asking for prompt logprobs reads
no cached prefix; its chunks' logits at every prompt position are computed (those rows only)
and scored as they prefill, and handed out on its first delta.
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from pagekv.kvnode.engine.config import EngineArgs
from pagekv.kvnode.engine.engine_stats import (
    EngineLoad,
    EngineStats,
    PeerPullStats,
    PrefixCacheStats,
)
from pagekv.kvnode.engine.handover_holds import HandoverHolds
from pagekv.kvnode.engine.hot_prefixes import HotPrefix, HotPrefixes
from pagekv.kvnode.engine.kv_export import ExportRun, KvExporter
from pagekv.kvnode.engine.logits_processors import SeqHistory
from pagekv.kvnode.engine.lora_adapters import (
    AdapterSlots,
    AdapterUnavailable,
    parse_lora_modules,
)
from pagekv.kvnode.engine.model_dtype import check_dtype
from pagekv.kvnode.engine.output_text import OutputText
from pagekv.kvnode.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from pagekv.kvnode.engine.peer_pull import Fetch, KvSource, PeerPuller, PullResult
from pagekv.kvnode.engine.prefix_admin import PrefixAdmin, PrefixHolding
from pagekv.kvnode.engine.prompt_logprobs import rows_to_score, score_tokens
from pagekv.kvnode.engine.pull_costs import PeerPullCosts
from pagekv.kvnode.engine.retention import PodRetention
from pagekv.kvnode.engine.sampler import make_generator, sample
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.engine.scheduler import Scheduler, Sequence, SequenceGroup
from pagekv.kvnode.engine.stop_checker import check_stop
from pagekv.kvnode.engine.tenancy import PodTenancy
from pagekv.kvnode.engine.tier_connector import (
    TierConnector,
    TierEvictor,
    build_tier_chain,
    kv_layout,
)
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.kvnode.memory.metrics import KVCacheMetrics
from pagekv.kvnode.memory.request import Request
from pagekv.kvnode.model.lora import LoraWeights, load_adapter
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index.schema import ROLE_DECODE
from pagekv.proto.medium import Medium
from pagekv.proto.requests import EMPTY_PROMPT, NoSuchAdapter
from pagekv.proto.retention import NO_CACHE_CONTROL, CacheControl
from pagekv.proto.tenants import TenantMap
from pagekv.proto.tier_stats import TierStats

logger = logging.getLogger(__name__)


# Steps with at least this many tokens are prefill-dominated: their time per token estimates
# the prefill cost (a decode-heavy step's fixed cost would swamp it).
PREFILL_SAMPLE_MIN_TOKENS = 128


class RequestRejected(ValueError):
    """A request that can never be served as asked (maps to INVALID_ARGUMENT)."""


class DuplicateRequestId(RequestRejected):
    """A request id that is already in flight (maps to ALREADY_EXISTS)."""


class Engine:
    def __init__(self, args: EngineArgs | None = None, *, tenants: TenantMap | None = None,
                 **kwargs) -> None:
        """`tenants`: the tenants file, for its quotas and shared region
        (kvnode/engine/tenancy.py)."""
        args = args or EngineArgs(**kwargs)
        self.args = args
        check_dtype(args.dtype, args.device)  # before the model loads: a refusal is quick
        if args.num_threads:
            # Oversubscribed cores make every parallel op wait at its barrier for a slice.
            torch.set_num_threads(args.num_threads)
        # vLLM's seed: requests without their own seed draw from this one generator (None:
        # torch's global one), so the same requests in the same order sample alike.
        self.default_generator = make_generator(args.seed)
        self.runner = ModelRunner(
            args.model,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            num_gpu_blocks=args.num_gpu_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            device=args.device,
            attention_backend=args.attention_backend,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        self.tokenizer = self.runner.tokenizer
        self.model_config = self.runner.model_config
        # LoRA adapters (kvnode/engine/lora_adapters.py): each --lora-modules entry is read
        # in full now, so a bad one stops the start here, in one line.
        self.adapters = AdapterSlots(args.max_loras, self.read_adapter, self._busy_adapters)
        for name, path in parse_lora_modules(args.lora_modules).items():
            self.adapters.register(name, path, self.read_adapter(name, path))
        self._failures: list[tuple[str, Exception]] = []  # queued requests failed since
        self.max_model_len = self.runner.max_model_len
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={args.max_num_batched_tokens} is below "
                f"max_model_len={self.max_model_len}: enable chunked prefill or raise it"
            )
        self.metrics = KVCacheMetrics(args.block_metrics_sample_rate)
        # The tiers come first: the pool is built with its eviction hook into them.
        # Pins and sessions (kvnode/engine/retention.py): read before the tiers, whose SSD
        # recovery already spares what the previous run retained.
        self.retention = PodRetention(args, self.runner.num_blocks, self.runner.block_bytes)
        table = self.retention.table
        self.tenancy = PodTenancy(tenants, self.tokenizer.encode, args.block_size,
                                  self.runner.block_bytes) if tenants is not None else None
        ledger = self.tenancy.ledger if self.tenancy is not None else None
        chain = build_tier_chain(self.runner, args.cpu_offload_bytes, args.disk_offload_bytes,
                                 args.disk_offload_dir, args.block_size, table,
                                 self.retention.cap_bytes(Medium.CPU),
                                 self.retention.cap_bytes(Medium.DISK), ledger)
        if chain is not None and not args.enable_prefix_caching:
            raise ValueError("offload tiers need prefix caching (blocks are found by hash)")
        self.kv_manager = KVCacheManager(
            self.runner.num_blocks,
            args.block_size,
            enable_caching=args.enable_prefix_caching,
            hash_algo=args.hash_algo,
            hash_seed=args.hash_seed,
            watermark=args.watermark,
            metrics=self.metrics,
            on_evict_many=TierEvictor(chain, self.runner) if chain is not None else None,
            retention=table,
            retained_cap_blocks=self.retention.cap_blocks[Medium.GPU],
            session_idle_s=args.session_idle_s,
            ledger=ledger,
        )
        self.tiers: TierConnector | None = None
        if chain is not None:
            self.tiers = TierConnector(chain, self.kv_manager, self.runner)
            if chain.ssd is not None and chain.full_state():
                logger.info("warm restart: %d blocks found on SSD", len(chain.full_state()))
        self.prefixes = PrefixAdmin(self.kv_manager, self.tiers, table)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=args.enable_chunked_prefill,
            prefix_loader=self._load_prefix,
            admit=self._adapter_ready,
            reserve_output=args.role == ROLE_DECODE,
        )
        self.puller: PeerPuller | None = None  # enable_peer_pull: the pod supplies a transport
        self.pull_costs: PeerPullCosts | None = None  # per holder, fitted from its pulls
        self.kv_layout = kv_layout(self.runner)  # what peers must share to exchange blocks
        # Peers pull from it: it reads and packs the blocks, the pod only sends the bytes.
        self.exporter = KvExporter(self.kv_manager, self.runner, chain, self.kv_layout,
                                   self.salt_block, self._adapter_path)
        # P/D: a finished prefill's prompt blocks, held for the decode pod's pull.
        self.holds = HandoverHolds(self.kv_manager)
        self.hot_prefixes = HotPrefixes()  # the most-hit prefixes, for a scale-out's pre-warm
        self.groups: dict[str, SequenceGroup] = {}
        # Requests whose prompt logprobs are not all computed yet: while it is empty, a step
        # spends nothing on them.
        self._scoring: dict[str, SequenceGroup] = {}
        # Ids of the live extra samples of n>1 requests ("<id>#<i>"): the block tables and tier
        # loads are keyed by sequence id, so a client id must never equal one of them.
        self._child_ids: set[str] = set()
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.num_steps = 0
        self.event_sinks: list = []  # callables receiving each step's KV events
        # Measured prefill cost, published to the router so it can weigh recompute against
        # a reload: the median seconds per token of recent prefill-heavy steps. A warm-up pass
        # at start-up keeps the first real step from being several times slower (allocator
        # and kernel warm-up), which would steer cold requests away from this pod. It is not
        # timed: pods starting together on one host would measure each other's start-up.
        self._prefill_samples: deque[float] = deque(maxlen=32)
        # Seconds of recent decode-only steps: with the prefill cost, the prompt tokens one
        # step can take without taking longer than a decode step (prefill_budget).
        self._decode_samples: deque[float] = deque(maxlen=32)
        self._prefill_budget = 0  # the last measure (an int: other threads read it)
        self._prefill_backlog = 0  # prompt tokens queued or part-computed, as of the last step
        self._warm_up()
        self.last_step_idle = False

    def _warm_up(self) -> None:
        """One prefill pass of a full step's tokens over free pool blocks before serving, so
        the largest activations are allocated and the kernels loaded before real traffic."""
        bs = self.args.block_size
        n = min(self.args.max_num_batched_tokens, self.max_model_len - 1,
                self.runner.num_blocks * bs)
        if n >= 1:
            self.runner.execute([SeqBatchItem([0] * n, 0, list(range(-(-n // bs))))])

    def enable_peer_pull(self, fetch: Fetch, max_concurrent: int = 4, deadline_s: float = 2.0,
                         observe: Callable[[PullResult], None] | None = None) -> PeerPuller:
        """Pull prefixes named by a request's kv_source from that peer (before serving);
        `observe` is called with each finished pull (on the engine thread)."""
        if not self.args.enable_prefix_caching:
            raise ValueError("cross-pod KV pull needs prefix caching (blocks are found by hash)")
        self.puller = PeerPuller(self.kv_manager, self.runner, self.kv_layout, fetch,
                                 max_concurrent=max_concurrent, deadline_s=deadline_s)
        self.pull_costs = PeerPullCosts()
        self.puller.observers.append(self.pull_costs.observe)
        if observe is not None:
            self.puller.observers.append(observe)
        return self.puller

    @property
    def hash_config(self) -> HashConfig:
        """How this pod hashes its blocks (peers and the index must hash alike)."""
        return self.kv_manager.hash_config

    def _load_prefix(self, req: Request, hit) -> bool:
        """The scheduler's hook: the tiers extend the pool hit, then a peer pull."""
        if self.tiers is not None and not self.tiers.load_prefix(req, hit):
            return False
        if self.puller is None:
            return True
        if not self.puller.load_prefix(req, hit):
            return False
        pulled = self.puller.take_result(req.request_id)
        group = self.groups.get(req.request_id)
        if pulled is not None and group is not None:  # what its usage reports
            group.kv_pull_s, group.kv_pull_fallback = pulled.seconds, pulled.failure or ""
        return True

    # -- LoRA adapters ----------------------------------------------------------------------
    def read_adapter(self, name: str, path: str) -> LoraWeights:
        """Any thread (the loader's): a PEFT adapter for this model, in its dtype; AdapterError."""
        return load_adapter(name, path, self.model_config, self.runner.dtype,
                            self.runner.device, self.args.max_lora_rank)

    def _busy_adapters(self) -> set[str]:
        return {s.req.lora_id for s in self.scheduler.running if s.req.lora_id}

    def _adapter_ready(self, req: Request) -> bool:
        """The scheduler's check: a request of an adapter waits until it is resident."""
        return req.lora_id is None or self.adapters.ready(req.lora_id) is not None

    def _adapter_path(self, name: str) -> str | None:
        try:
            return self.adapters.path_of(name)
        except NoSuchAdapter:
            return None

    def _fail_adapter_waiters(self) -> None:
        """Waiting requests whose adapter failed to load fail with the loader's reason (or,
        unloaded meanwhile, as an unknown adapter)."""
        for seq in list(self.scheduler.waiting):
            name = seq.req.lora_id
            why = self.adapters.failed.get(name) if name else None
            if name and why is not None and seq.group.request_id in self.groups:
                rid = seq.group.request_id
                self.abort(rid)
                error = AdapterUnavailable(why) if self.adapters.knows(name) else \
                    NoSuchAdapter(name)
                self._failures.append((rid, error))
        self.adapters.failed.clear()  # a later request may try again (the file may be fixed)

    def take_failures(self) -> list[tuple[str, Exception]]:
        """Queued requests the engine failed since the last call (aborted already), each with
        the error its caller gets."""
        failures, self._failures = self._failures, []
        return failures

    # -- requests -------------------------------------------------------------------------
    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Reject, naming the limit, what can never be served."""
        n_prompt = len(prompt_token_ids)
        if n_prompt == 0:
            raise RequestRejected(EMPTY_PROMPT)
        vocab = self.model_config.vocab_size
        for t in prompt_token_ids:
            if type(t) is not int or not 0 <= t < vocab:
                raise RequestRejected(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        if n_prompt >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {n_prompt} tokens; max_model_len={self.max_model_len} leaves no "
                f"room for one output token"
            )
        room = self.max_model_len - n_prompt
        if params.max_tokens > room:
            raise RequestRejected(
                f"max_tokens={params.max_tokens} exceeds the remaining context: prompt "
                f"{n_prompt} + max_tokens must be <= max_model_len={self.max_model_len} "
                f"(at most {room})"
            )
        if params.n > self.args.max_n:
            raise RequestRejected(f"n={params.n} exceeds the configured maximum max_n={self.args.max_n}")
        bs = self.args.block_size
        need = -(-(n_prompt + params.max_tokens) // bs)
        if need > self.runner.num_blocks:
            raise RequestRejected(
                f"request needs {need} KV blocks (prompt {n_prompt} + max_tokens "
                f"{params.max_tokens}) but the pool has {self.runner.num_blocks}: it can never fit"
            )

    def add_request(
        self,
        request_id: str | None,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        lora_id: str | None = None,
        arrival_time: float | None = None,
        kv_source: KvSource | None = None,
        prompt: str | None = None,
        hold_s: float = 0.0,
        cache_control: CacheControl = NO_CACHE_CONTROL,
        tenant: str = "",
    ) -> str:
        """Queue a request; `prompt` is its text when the client gave text (it is handed back
        in its outputs, as vLLM's RequestOutput.prompt). `hold_s` > 0: a P/D prefill, whose
        prompt blocks are held that long for a decode pod's pull once it finishes.
        `cache_control`: a pin, one-shot or session (proto/retention.py); `tenant`: whose
        quota its blocks count against (kvnode/engine/tenancy.py)."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.groups or request_id in self._child_ids:
            raise DuplicateRequestId(f"request id {request_id!r} is already in use")
        prompt_ids = list(prompt_token_ids)
        self.validate(prompt_ids, params)
        lora_path = self.adapters.path_of(lora_id) if lora_id else None  # NoSuchAdapter
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        group = SequenceGroup(request_id, prompt_ids, params, metrics, cache_salt, lora_id,
                              prompt=prompt, hold_s=hold_s)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first token has none
            if len(prompt_ids) > 1:
                group.skip_reading_prefix_cache = True  # every position is computed
                self._scoring[request_id] = group
        req = Request(request_id, prompt_ids, cache_salt=cache_salt, lora_id=lora_id,
                      lora_path=lora_path, cache_control=cache_control, tenant=tenant,
                      shared_blocks=self.salt_block(prompt_ids))
        gen = self.default_generator if params.seed is None else make_generator(params.seed)
        seq = Sequence(req, group, 0, gen,
                       text=OutputText(params.skip_special_tokens))
        group.seqs.append(seq)
        self.groups[request_id] = group
        if (kv_source is not None and self.puller is not None and kv_source.num_blocks > 0
                and not group.skip_reading_prefix_cache):
            self.puller.sources[request_id] = kv_source
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and give its blocks back; returns its final (aborted) delta."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self._scoring.pop(request_id, None)
        for seq in group.seqs:
            if seq.finish_reason is None:  # a finished one was released (its id may be reused)
                self._release(seq)
                seq.finish_reason = "abort"
                seq.text.flush(self.tokenizer, seq.req.output_token_ids)
        group.forked = True
        return self._delta(group, time.monotonic())

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def idle_tick(self) -> None:
        """What is owed while no request is unfinished (no step runs): the pool blocks of a
        pull its request gave up go back once the pull's worker is out."""
        if self.puller is not None and self.puller.has_pending():
            self.puller.finish_pulls()
        self.holds.expire()
        self.retention.tick()
        self._prefill_backlog = 0  # nothing unfinished: nothing queued

    def release_handover(self, handover_id: str) -> bool:
        """Engine thread. A decode pod was served the blocks held under `handover_id` (a
        prefill's request id): they go to the prefix cache (once no transfer reads them).
        False when no such hold is left."""
        return self.holds.release(handover_id)

    def lend_handover(self, handover_id: str, block_hashes: Seq[bytes],
                      parent_hash: bytes | None) -> ExportRun | None:
        """Any thread. A run of the blocks held under `handover_id` to serve a pull from,
        without the engine thread (they are pinned by the hold, which lasts until
        `return_handover`); None when the hold does not have them all."""
        blocks = self.holds.lend(handover_id, block_hashes)
        if blocks is None:
            return None
        return ExportRun(list(block_hashes), [Medium.GPU] * len(blocks), blocks,
                         parent=parent_hash)

    def return_handover(self, handover_id: str) -> None:
        """Any thread. The transfer of a `lend_handover` run is over."""
        self.holds.give_back(handover_id)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.tiers is not None:
            self.tiers.finish_loads()  # finished SSD loads release their pins before scheduling
        if self.puller is not None:
            self.puller.finish_pulls()
        self.holds.expire()
        self.retention.tick()
        if self.args.role == ROLE_DECODE:
            self.scheduler.prefill_budget = self._prefill_budget or None
        if self.adapters.failed:
            self._fail_adapter_waiters()
        sched = self.scheduler.schedule()
        self._prefill_backlog = self.scheduler.prefill_backlog()
        self.num_steps += 1
        self.last_step_idle = not sched.scheduled
        if not sched.scheduled:
            self._publish_events()
            if self.tiers is not None and self.tiers.has_pending_loads():
                self.tiers.wait_for_loads(0.05)  # let the loader thread have the GIL
            elif self.puller is not None and self.puller.has_pending():
                self.puller.wait_for_pulls(0.05)
            return []
        copies = self.kv_manager.take_block_copies()
        if copies:
            self.runner.copy_blocks(copies)
        mgr = self.kv_manager
        batch = []
        for seq, n in sched.scheduled:
            req = seq.req
            start = req.num_computed_tokens
            batch.append(
                SeqBatchItem(
                    req.all_token_ids[start : start + n], start, mgr.get_block_ids(req.request_id),
                    self.adapters.resident_weights(req.lora_id) if req.lora_id else None,
                )
            )
        scored = self._rows_to_score(sched.scheduled) if self._scoring else None
        t0 = time.perf_counter()
        if scored:
            logits, prompt_logits = self.runner.execute_with_token_logits(
                batch, [(i, off, count) for i, _, off, count in scored])
            self._record_prompt_logprobs(scored, prompt_logits)
        else:
            logits = self.runner.execute(batch)
        now = time.monotonic()
        # A step that also scored prompt logprobs would overstate what a prefill costs.
        if sched.num_batched_tokens >= PREFILL_SAMPLE_MIN_TOKENS and not scored:
            self._prefill_samples.append((time.perf_counter() - t0) / sched.num_batched_tokens)
            self._prefill_budget = self._measure_prefill_budget()
        elif sched.num_batched_tokens == len(sched.scheduled) and not scored:
            self._decode_samples.append(time.perf_counter() - t0)
            self._prefill_budget = self._measure_prefill_budget()

        rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        for row, (seq, n) in enumerate(sched.scheduled):
            req = seq.req
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: its logits are not a next-token prediction
            group = seq.group
            if not group.forked and group.params.n > 1:
                self._fork_children(seq)
                for child in group.seqs:
                    rows.append(row)
                    sampling_seqs.append(child)
            else:
                rows.append(row)
                sampling_seqs.append(seq)

        touched: dict[str, SequenceGroup] = {}
        if sampling_seqs:
            params = [s.group.params for s in sampling_seqs]
            histories = None
            if any(p.needs_history for p in params):  # only then: the plain path costs nothing
                histories = [self._history(s, logits.device) for s in sampling_seqs]
            out = sample(logits[rows], params, [s.generator for s in sampling_seqs],
                         histories, self.eos_token_ids)
            logprobs = out.logprobs or [None] * len(sampling_seqs)
            for seq, tok, lp in zip(sampling_seqs, out.tokens, logprobs, strict=True):
                self._append_token(seq, tok, lp, now)
                touched[seq.group.request_id] = seq.group
        self._publish_events()
        return [self._delta(g, now) for g in touched.values()]

    def _rows_to_score(self, scheduled: list[tuple[Sequence, int]]
                       ) -> list[tuple[int, SequenceGroup, int, int]]:
        """(batch item, its request, offset, count): the new tokens of this step whose
        logits score a prompt token of a request asking for prompt logprobs."""
        out = []
        for i, (seq, n) in enumerate(scheduled):
            group = seq.group
            if group.request_id not in self._scoring or group.prompt_logprobs is None:
                continue
            rows = rows_to_score(seq.req.num_computed_tokens, n, len(group.prompt_token_ids),
                                 len(group.prompt_logprobs))
            if rows is not None:
                out.append((i, group, *rows))
        return out

    def _record_prompt_logprobs(self, scored: list[tuple[int, SequenceGroup, int, int]],
                                logits: torch.Tensor) -> None:
        """Score the prompt tokens `scored` predicts, from their rows' logits (in order)."""
        targets: list[int] = []
        num_top: list[int] = []
        for _, group, _, count in scored:
            first = len(group.prompt_logprobs or ())
            targets += group.prompt_token_ids[first : first + count]
            num_top += [group.params.prompt_logprobs or 0] * count
        entries = score_tokens(logits, targets, num_top)
        at = 0
        for _, group, _, count in scored:
            assert group.prompt_logprobs is not None  # (in _scoring: it asked)
            group.prompt_logprobs += entries[at : at + count]
            at += count
            if len(group.prompt_logprobs) == len(group.prompt_token_ids):
                del self._scoring[group.request_id]
                group.skip_reading_prefix_cache = False  # a recompute may read the cache now

    def _fork_children(self, parent: Sequence) -> None:
        group = parent.group
        base_seed = group.params.seed
        for i in range(1, group.params.n):
            cid = f"{group.request_id}#{i}"
            if cid in self.groups or cid in self._child_ids:  # a client's request has this id
                cid = f"{cid}#{uuid.uuid4().hex}"
            self._child_ids.add(cid)
            child_req = Request(
                cid, group.prompt_token_ids, cache_salt=group.cache_salt, lora_id=group.lora_id,
                tenant=parent.req.tenant, shared_blocks=parent.req.shared_blocks,
                lora_path=parent.req.lora_path,
            )
            gen = self.default_generator if base_seed is None else make_generator(base_seed + i)
            child = Sequence(child_req, group, i, gen,
                             text=OutputText(group.params.skip_special_tokens))
            self.kv_manager.fork(parent.req, child_req)
            group.seqs.append(child)
            self.scheduler.running.append(child)
        group.forked = True

    @staticmethod
    def _history(seq: Sequence, device: torch.device) -> SeqHistory:
        group = seq.group
        if group.params.repetition_penalty != 1.0 and group.prompt_ids_tensor is None:
            group.prompt_ids_tensor = torch.tensor(group.prompt_token_ids, device=device)
        return SeqHistory(seq.req.output_token_ids, group.prompt_ids_tensor)

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None,
                      now: float) -> None:
        req = seq.req
        req.append_output_token_ids(token)
        group = seq.group
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        if seq.index == 0:
            m.token_times.append(now)
        if logprobs is not None:
            seq.new_logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs.logprob
        check_stop(seq, self.tokenizer, self.eos_token_ids, self.max_model_len)
        if seq.finish_reason is not None:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """A sequence is done (finished or aborted): its blocks and tier loads go back (a
        finished P/D prefill's prompt blocks stay held for the decode pod)."""
        group = seq.group
        if group.hold_s > 0 and seq.index == 0 and seq.finish_reason not in (None, "abort"):
            bs = self.args.block_size
            full = len(group.prompt_token_ids) // bs
            blocks = self.kv_manager.get_blocks(seq.req.request_id)[:full]
            self.holds.hold(group.request_id,
                            [b for b in blocks if b.block_hash is not None], group.hold_s)
        req = seq.req
        if req.lora_id and seq.index == 0 and seq.finish_reason != "abort":
            self.adapters.note_request(req.lora_id, len(group.prompt_token_ids),
                                       group.num_cached_tokens)
        if req.num_hit_blocks and seq.index == 0 and seq.finish_reason != "abort":
            n = req.num_hit_blocks  # (its deepest hit: what a scale-out pod pre-warms)
            self.hot_prefixes.record(req.block_hashes[n - 1],
                                     req.prompt_token_ids[: n * self.args.block_size],
                                     req.cache_salt, req.lora_id, req.tenant)
        self.scheduler.remove(seq)
        self._child_ids.discard(seq.req.request_id)
        if self.tiers is not None:
            self.tiers.forget(seq.req.request_id)
        if self.puller is not None:
            self.puller.forget(seq.req.request_id)

    def _delta(self, group: SequenceGroup, now: float) -> RequestOutput:
        completions = []
        for seq in group.seqs:
            if seq.sent_finish:
                continue  # an n>1 sibling that finished earlier: nothing new to say
            out = seq.req.output_token_ids
            new_tokens = out[seq.sent_tokens :]
            seq.sent_tokens = len(out)
            done = seq.finish_reason is not None
            text = seq.text.take(group.params.stop, done)
            logprobs = cumulative = None
            if group.params.logprobs is not None:
                logprobs, seq.new_logprobs = seq.new_logprobs, []
                cumulative = seq.cumulative_logprob
            completions.append(CompletionOutput(seq.index, new_tokens, text, seq.finish_reason,
                                                logprobs, seq.stop_reason, cumulative))
            seq.sent_finish = done
        finished = group.finished
        if finished:
            group.metrics.finished_time = now
            self.groups.pop(group.request_id, None)
        prompt_logprobs = None
        if (group.prompt_logprobs is not None and not group.prompt_logprobs_sent
                and len(group.prompt_logprobs) == len(group.prompt_token_ids)):
            prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, True
        return RequestOutput(
            group.request_id,
            group.prompt_token_ids,
            completions,
            finished=finished,
            num_cached_tokens=group.num_cached_tokens,
            cached_tokens_by_tier=dict(group.cached_tokens_by_tier),
            metrics=group.metrics,
            prompt=group.prompt,
            prompt_logprobs=prompt_logprobs,
            kv_pull_s=group.kv_pull_s,
            kv_pull_fallback=group.kv_pull_fallback,
        )

    def _publish_events(self) -> None:
        events = self.kv_manager.take_events()
        if self.tiers is not None:
            events.extend(self.tiers.take_events())
        if events:
            for sink in self.event_sinks:
                sink(events)

    @property
    def prefill_s_per_token(self) -> float | None:
        if not self._prefill_samples:
            return None
        return statistics.median(self._prefill_samples)

    @property
    def decode_step_s(self) -> float | None:
        """The median seconds of recent decode-only steps (None before the first)."""
        if not self._decode_samples:
            return None
        return statistics.median(self._decode_samples)

    def _measure_prefill_budget(self) -> int:
        """Prompt tokens one step can compute in about a decode step's time (measured: the
        median decode-only step over the median prefill cost a token), at least a block and
        at most the step's token budget; 0 until both are measured. A decode pod caps each
        step's prefill there (its step time stays flat), and the router splits a prompt
        whose uncached part is longer (it would stall this pod's decodes a step or more)."""
        if not self._prefill_samples or not self._decode_samples:
            return 0
        per_token = statistics.median(self._prefill_samples)
        step = statistics.median(self._decode_samples)
        tokens = int(step / per_token) if per_token > 0 else self.args.max_num_batched_tokens
        return max(self.args.block_size, min(tokens, self.args.max_num_batched_tokens))

    # -- cache state ----------------------------------------------------------------------
    def full_state(self) -> dict[bytes, Medium]:
        """Every block hash this pod can serve, with its tier (the index republishes this)."""
        state = dict.fromkeys(self.kv_manager.cached_hashes(), Medium.GPU)
        if self.tiers is not None:
            state.update(self.tiers.full_state())
        return state

    def reset_prefix_cache(self, include_tiers: bool = False) -> tuple[bool, int]:
        """Forget cached prefixes; refused while requests run. Returns (ok, blocks cleared)."""
        n = len(self.kv_manager.cached_hashes())
        if not self.kv_manager.reset_prefix_cache():
            return False, 0
        if include_tiers and self.tiers is not None:
            n += self.tiers.clear()
        self._publish_events()
        return True, n

    # -- an operator's calls (engine thread) ------------------------------------------------
    def salt_block(self, token_ids: Seq[int]) -> int:
        """The block of a prompt that carries its salt: after its shared-region blocks."""
        return self.tenancy.shared_blocks(token_ids) if self.tenancy is not None else 0

    def prefix_hashes(self, token_ids: Seq[int], cache_salt: str | None) -> list[bytes]:
        """A prompt's full-block hashes, as its admission would hash them."""
        ids = list(token_ids)
        return hash_prompt(self.hash_config, self.args.block_size, ids, cache_salt or None,
                           salt_block=self.salt_block(ids))

    def hot_prefixes_held(self, n: int) -> list[HotPrefix]:
        """The `n` most-hit prefixes whose last block this pod still holds (in any tier):
        what a scale-out peer can pull from here."""
        return [p for p in self.hot_prefixes.top(2 * n + 8)
                if self.prefixes.locate([p.key]).total][:n]

    def chain_ending_at(self, block_hash: bytes) -> list[bytes]:
        return self.prefixes.chain_ending_at(block_hash)

    def locate(self, block_hashes: Seq[bytes]) -> PrefixHolding:
        """Where this pod holds the prefix's blocks (pool, DRAM, SSD) and how many are retained."""
        return self.prefixes.locate(block_hashes)

    def delete_prefix(self, block_hashes: Seq[bytes]) -> PrefixHolding:
        """Delete the prefix's blocks everywhere on this pod; what went."""
        gone = self.prefixes.delete(block_hashes)
        self._publish_events()
        return gone

    # -- stats ----------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        """How busy the pod is: integer reads (the index lease reads it each renewal)."""
        mgr = self.kv_manager
        return EngineLoad(len(self.scheduler.waiting), len(self.scheduler.running),
                          mgr.get_num_free_blocks(), mgr.num_blocks, self._prefill_budget,
                          self._prefill_backlog)

    def stats(self) -> EngineStats:
        """The pod's figures, copied now (any thread: a scrape, the Stats call)."""
        mgr = self.kv_manager
        block_bytes = self.runner.block_bytes
        pool = TierStats(Medium.GPU, int(mgr.usage * mgr.num_blocks) * block_bytes,
                         mgr.num_blocks * block_bytes, len(mgr.cached_hashes()))
        m = self.metrics
        prefix = PrefixCacheStats(
            m.prefix_requests, m.prefix_queries_tokens, dict(m.prefix_hits_tokens_by_tier),
            m.hit_rate, m.pool_too_small(), m.block_lifetime_seconds.buckets_copy(),
            m.block_idle_before_evict_seconds.buckets_copy(),
            m.block_reuse_gap_seconds.buckets_copy())
        peer = None
        if self.puller is not None:
            p = self.puller.stats
            peer = PeerPullStats(p.pulls, p.blocks, p.bytes, dict(p.fallbacks), p.s_per_token())
        return EngineStats(
            load=self.load(),
            usage=mgr.usage,
            num_preemptions=self.scheduler.num_preemptions,
            pool=pool,
            chain=self.tiers.tier_stats() if self.tiers is not None else None,
            prefix_cache=prefix,
            peer_pull=peer,
            handover=self.holds.stats(),
            role=self.args.role,
            costs=self.tier_costs(),
            decode_step_s=self.decode_step_s,
            retention=self.retention.stats(
                mgr.cached_hashes().__contains__,
                self.tiers.media_below if self.tiers is not None else None),
            tenancy=self.tenancy.stats() if self.tenancy is not None else None,
            adapters=self.adapters.stats(),
        )

    def tier_costs(self) -> dict[str, float]:
        """Measured seconds per token, published to the router: "prefill" (recompute), each
        tier reloaded from so far, and "peer" (complete pulls, landing included); a figure
        not measured yet is absent. Per holder pulled from, "peer.<pod>" and
        "peer_fixed.<pod>" (proto/pull_cost.py), and "peer" is then their median."""
        costs: dict[str, float] = {}
        if self.prefill_s_per_token is not None:
            costs["prefill"] = self.prefill_s_per_token
        if self.tiers is not None:
            # (keyed by medium: a Medium is the str it names, as a key of this dict of str)
            costs.update(self.tiers.reload_s_per_token(self.runner.kv_bytes_per_token).items())
        peer = self.puller.stats.s_per_token() if self.puller is not None else None
        if peer is not None:
            costs["peer"] = peer
        if self.pull_costs is not None:
            costs.update(self.pull_costs.cost_map())
        return costs

    def close(self) -> None:
        """Flush and close the tiers (the SSD tier's manifest must be consistent on exit)."""
        self.holds.close()
        if self.puller is not None:
            self.puller.close()
        if self.tiers is not None:
            self.tiers.close(persist=self.args.disk_offload_persist)
        self.retention.tick(force=True)
        self.adapters.close()
