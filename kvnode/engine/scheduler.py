"""Continuous batching under a token budget, chunked prefill, preemption by recompute.

Each step: running sequences first (decodes and unfinished prefill chunks, oldest first),
then waiting ones (FCFS) while the token budget and `max_num_seqs` allow. When the pool
cannot hold a running sequence's next tokens, the newest running sequence gives its blocks
back and re-enters the waiting queue at the front; its full blocks stay hashed in the pool, so
its recompute is mostly prefix hits. No admission happens in a step that preempted. A request
still computing its prompt logprobs reads no cached prefix (`skip_reading_prefix_cache`). A decode pod's scheduler (`--role decode`) also caps the
prompt tokens of a step at its `prefill_budget` and admits a request only when its output
fits beside every running sequence's (`reserve_output`): its decodes neither stall nor get
preempted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagekv.kvnode.engine.output_text import OutputText
from pagekv.kvnode.engine.outputs import RequestMetrics, TokenLogprobs
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager, PrefixHit
from pagekv.kvnode.memory.request import Request
from pagekv.proto.medium import MEDIUMS, Medium

logger = logging.getLogger(__name__)

# A decode pod reserves each sequence's output this far ahead at most: a request that leaves
# max_tokens unset ("up to the context") would otherwise reserve the whole context and a
# decode pod would admit one chat at a time; past it a very long output may still preempt.
RESERVE_HORIZON_TOKENS = 1024


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One client request: its parameters, and n sequences once the prompt is prefilled."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    cache_salt: str | None = None
    lora_id: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    num_cached_tokens: int = 0
    # Per medium; a "PEER" entry (proto.medium.PEER_SHARE) when tokens were pulled.
    cached_tokens_by_tier: dict[Medium | str, int] = field(
        default_factory=lambda: dict.fromkeys(MEDIUMS, 0)
    )
    # The prompt as a tensor, made once for the repetition penalty (sampler.SeqHistory).
    prompt_ids_tensor: torch.Tensor | None = None
    prompt: str | None = None  # the prompt's text, when the client gave text
    # SamplingParams.prompt_logprobs: the entries so far (the first is None), one per prompt
    # token once complete; `prompt_logprobs_sent` once a delta carried them.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    # vLLM's flag: while its prompt logprobs are being computed, a request reads no cached
    # prefix (pool, tiers or peer): every prompt position needs its logits.
    skip_reading_prefix_cache: bool = False
    hold_s: float = 0.0  # a P/D prefill: its prompt blocks are held this long once finished
    # Its peer pull, once admitted (a P/D handover on a decode pod): seconds the admission
    # waited for it, and its fallback reason ("" : none).
    kv_pull_s: float = 0.0
    kv_pull_fallback: str = ""

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs) and (
            self.forked or self.params.n == 1
        )


@dataclass(slots=True, eq=False)
class Sequence:
    req: Request
    group: SequenceGroup
    index: int
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # Streaming state: how much of the output was already handed out.
    sent_tokens: int = 0
    text: OutputText = field(default_factory=OutputText)  # decoded, and not yet handed out
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # not yet handed out
    cumulative_logprob: float = 0.0  # of the tokens sampled so far (when logprobs are asked)
    sent_finish: bool = False  # its finish_reason was handed out: later deltas skip it


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]  # (sequence, number of new tokens to compute)
    preempted: list[Sequence]
    num_batched_tokens: int


# Hook for the tier chain: given a waiting request and its pool hit, load what the lower
# tiers hold into fresh pool blocks and extend the hit in place (True), or say that a load
# from SSD is still running (False: the request waits; others are served).
PrefixLoader = Callable[[Request, PrefixHit], bool]
# Whether a waiting request may be admitted now (False: its LoRA adapter is still loading;
# it waits, others are served).
AdmitCheck = Callable[[Request], bool]


class Scheduler:
    def __init__(
        self,
        manager: KVCacheManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        prefix_loader: PrefixLoader | None = None,
        reserve_output: bool = False,
        admit: AdmitCheck | None = None,
    ) -> None:
        self.manager = manager
        self.admit = admit
        # A decode pod's: admit only what fits with its whole output, and every running
        # sequence's too, so a decode never preempts (Scheduler._fits).
        self.reserve_output = reserve_output
        # A decode pod's: prompt tokens (prefill chunks) a step may compute besides its
        # decodes (None: the whole token budget), so its step time stays flat.
        self.prefill_budget: int | None = None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.prefix_loader = prefix_loader
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its blocks back (abort, finish)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.req.request_id in self.manager.req_to_blocks:
            self.manager.free(seq.req)

    def prefill_backlog(self) -> int:
        """Prompt tokens still to compute, waiting and running (the router weighs a prefill
        pod's queue by it)."""
        return sum(max(0, s.req.num_prompt_tokens - s.req.num_computed_tokens)
                   for queue in (self.waiting, self.running) for s in queue)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.manager.free(seq.req, preempted=True)
        seq.req.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s (recompute)", seq.req.request_id)

    def _output_blocks(self, seq: Sequence, tokens: int) -> int:
        """Blocks a sequence of `tokens` tokens needs to reach its max_tokens (at most
        RESERVE_HORIZON_TOKENS ahead)."""
        bs = self.manager.block_size
        left = max(0, seq.group.params.max_tokens - len(seq.req.output_token_ids))
        return -(-(tokens + min(left, RESERVE_HORIZON_TOKENS)) // bs)

    def _fits(self, seq: Sequence, hit: PrefixHit) -> bool:
        """With reserve_output: the pool's free blocks cover this request's prompt and
        output (its n samples each) after every running sequence's own rest of output."""
        mgr = self.manager
        reserved = 0
        for r in self.running:
            held = len(mgr.req_to_blocks.get(r.req.request_id, ()))
            reserved += max(0, self._output_blocks(r, r.req.num_tokens) - held)
        n = seq.group.params.n
        need = self._output_blocks(seq, seq.req.num_tokens) - len(hit.blocks)
        bs = mgr.block_size
        need += (n - 1) * -(-min(seq.group.params.max_tokens, RESERVE_HORIZON_TOKENS) // bs)
        return mgr.get_num_free_blocks() - reserved >= need

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunked = self.enable_chunked_prefill
        # Prompt tokens this step may still take (a decode pod's cap; else the budget's).
        prefill_left = self.prefill_budget if chunked and self.prefill_budget else budget
        # Under a cap, a running prefill (a long prompt) leaves half of it to the waiting
        # ones: a chat turn arriving meanwhile is admitted now, not after the whole prompt.
        held_back = prefill_left // 2 if self.prefill_budget and self.waiting else 0
        prefill_left -= held_back
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        mgr = self.manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            req = seq.req
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > 1 and num_new > prefill_left:  # a prefill chunk past the cap
                if prefill_left < 1:
                    i += 1
                    continue
                num_new = prefill_left
            if num_new > budget:
                if not chunked:
                    i += 1
                    continue
                num_new = budget
            while mgr.allocate_slots(req, num_new) is None:
                victim = self.running.pop()  # the newest running sequence
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if preempted and preempted[-1] is seq:
                break
            scheduled.append((seq, num_new))
            budget -= num_new
            if num_new > 1:
                prefill_left -= num_new
            i += 1

        prefill_left += held_back
        now = time.monotonic()
        idx = 0  # waiting sequences whose tier loads are still running are skipped, not lost
        while (
            not preempted
            and idx < len(self.waiting)
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[idx]
            req = seq.req
            if self.admit is not None and not self.admit(req):
                idx += 1  # its adapter is loading: serve others meanwhile
                continue
            # The only lookup of this admission: the tiers (and a peer) extend it.
            skip = seq.group.skip_reading_prefix_cache
            hit = mgr.lookup(req, skip_reading=skip)
            if not skip and self.prefix_loader is not None and not self.prefix_loader(req, hit):
                idx += 1  # an SSD load is in flight: serve others meanwhile
                continue
            num_hit = hit.num_tokens
            num_new = req.num_tokens - num_hit
            if num_new > 1 and num_new > prefill_left:
                if prefill_left < 1:
                    break
                num_new = prefill_left
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            if self.reserve_output and self.running and not self._fits(seq, hit):
                break
            if mgr.allocate_slots(req, num_new, hit) is None:
                break
            req.num_computed_tokens = num_hit
            del self.waiting[idx]
            self.running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
            if num_new > 1:
                prefill_left -= num_new
            group = seq.group
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                group.num_cached_tokens = num_hit
                group.cached_tokens_by_tier = group.cached_tokens_by_tier | hit.by_tier()
        return SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - budget)
