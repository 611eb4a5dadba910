"""Each forwarded call's predicted TTFT against the one measured, per pod (router side).

`start` predicts a call's first token when it is sent (router/ttft_model.py: the pod's own
work at the costs it fitted and published) and hands back a ticket; `first_token` (a
stream's first chunk) or `unary_done` (a unary response, its decode steps taken off)
measures it; `close` forgets a ticket whose call failed or moved on.

The work queued ahead of a call is the router's own clock per pod, not the pod's published
load: that is up to a lease renewal (a second) old, while one router's requests are the
queue of the pods it feeds, and their first tokens say exactly when the pod got through
them. The clock (`busy_until`) is the last pending call's expected first token: a call adds
its own predicted work behind what is pending; a first token that comes early or late moves
the pending calls after it by as much (they queue behind it), and so does a call still
waiting at the time it was expected: when a new call is priced, the pod is behind by at
least the oldest pending call's lateness. With nothing of ours pending, a published prefill
backlog newer than our last first token there (other routers' work) is the floor.

One figure the pods do not publish is fitted here, per pod: the attention of a call's new
tokens over its cached prefix (router/ttft_model.py), in units of the pod's published
prefill cost (so that it follows the pod's speed), as the median over the pod's last
ATTENTION_WINDOW calls that found the pod idle (nothing else of ours in flight there: no
prefill ahead, no decode beside it) and had at least ATTENTION_MIN_PAIRS pairs, of what
their TTFT left over the rest of the model, per pair (at least ATTENTION_MIN_SAMPLES of
them; 0 before; at most ATTENTION_MAX_PER_PREFILL). A median, and idle calls only: one call
slowed by the host, or by a batch beside it, must not move it.

Pods on one host slow each other down (a shared CPU, memory bandwidth, the host's other
work): on bench/ttft_prediction.py's 2-core box a call whose pod found nothing of ours ahead
took 1.7x its prediction when the other pod was prefilling meanwhile, 1.1x when it was
not. So each pod fits a factor for its calls sent while another pod had a prefill of ours
pending, from those that found nothing of ours ahead on it: the median of their measured
over predicted own work (CONTEXT_WINDOW calls, at least CONTEXT_MIN_SAMPLES, within
[1/CONTEXT_CLAMP, CONTEXT_CLAMP]; 1 before). The other calls stand at the pod's figures
(and the attention fit, which learns from them). A fleet on hosts of their own fits about
1.

The errors are kept per pod and predictor: "model" (this) and "cost_s" (the scorer's cost,
the naive predictor, as the baseline), as the rolling MAPE gauge, a histogram of predicted
over measured, and a debug log line per call.

No broader router-side correction of the pods' figures: a per-pod median ratio, a ridge fit
of the own work (fixed, per uncached, per cached token, per decode batched beside it) and a
ratio over the last few calls were each measured against the pods' figures alone on the
same calls (bench/ttft_prediction.py, a shared 2-core box) and each predicted worse: the
noise of a shared host moves faster than a window of calls can follow.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from pagekv.proto.index.pod_record import PodInfo
from pagekv.router.metrics import TTFT_PREDICTORS, RouterMetrics
from pagekv.router.scoring import CostModel, Score
from pagekv.router.ttft_errors import RollingErrors
from pagekv.router.ttft_model import (
    TtftPrediction,
    attention_pairs,
    backlog_seconds,
    pod_figures,
    predict,
)

logger = logging.getLogger(__name__)

CONTEXT_WINDOW = 16
CONTEXT_MIN_SAMPLES = 3
CONTEXT_CLAMP = 3.0
ATTENTION_WINDOW = 16
ATTENTION_MIN_SAMPLES = 3
ATTENTION_MIN_PAIRS = 64 * 512  # 64 new tokens over a 512-token prefix, or more
# At most this per pair, in prefill tokens: attending to a cached token costs less than
# computing one (measured: 4e-4 for SmolLM2-135M on a CPU); a sample above it is noise.
ATTENTION_MAX_PER_PREFILL = 0.01


@dataclass(slots=True, eq=False)
class TtftTicket:
    """One call's prediction, until its first token is measured."""

    pod_id: str
    seq: int
    sent: float          # perf_counter at the call
    predicted_s: float   # as predicted at the call
    naive_s: float       # the scorer's cost_s
    ahead_s: float
    own_s: float         # what it added to the pod's clock
    step_s: float        # the pod's step: a unary call's decode steps are taken off with it
    expected_at: float   # perf_counter of its first token, as the clock now expects it
    # A sample for the pod's attention figure (found nothing of ours ahead, priced at the
    # pod's own figures, a long enough prefix): (its own work less attention, pairs, prefill).
    attention: tuple[float, int, float] | None = None
    others_busy: bool = False  # another pod had a prefill of ours pending when it was sent
    measured_costs: bool = False  # the pod's own figures priced it (not the configured)
    base_own_s: float = 0.0    # its own work before the context factor
    open: bool = True


@dataclass(slots=True)
class _PodClock:
    idle_at: float = 0.0  # perf_counter of the last first token of ours seen there
    pending: list[TtftTicket] = field(default_factory=list)  # in the order sent
    last_first_token: float = 0.0  # unix time (the published load's clock)
    # Per pair of (new token, cached token), in units of the pod's prefill s/token.
    attention: deque[float] = field(default_factory=lambda: deque(maxlen=ATTENTION_WINDOW))

    # Measured over predicted own work of calls sent while other pods were busy.
    busy_ratios: deque[float] = field(default_factory=lambda: deque(maxlen=CONTEXT_WINDOW))

    def factor(self, others_busy: bool) -> float:
        ratios = self.busy_ratios
        if not others_busy or len(ratios) < CONTEXT_MIN_SAMPLES:
            return 1.0
        return min(CONTEXT_CLAMP, max(1.0 / CONTEXT_CLAMP, statistics.median(ratios)))

    def attention_per_prefill(self) -> float:
        if len(self.attention) < ATTENTION_MIN_SAMPLES:
            return 0.0
        return min(ATTENTION_MAX_PER_PREFILL, max(0.0, statistics.median(self.attention)))

    def busy_until(self) -> float:
        """When the pod will be through every prefill of ours (perf_counter)."""
        return max([self.idle_at, *(t.expected_at for t in self.pending)])


class TtftTracker:
    def __init__(self, metrics: RouterMetrics, costs: CostModel, window: int = 100) -> None:
        self.metrics = metrics
        self.costs = costs
        self.errors = RollingErrors(window)
        self._clocks: dict[str, _PodClock] = {}
        self._seq = 0

    def _clock(self, pod_id: str) -> _PodClock:
        clock = self._clocks.get(pod_id)
        if clock is None:
            clock = self._clocks[pod_id] = _PodClock()
        return clock

    def start(self, score: Score, info: PodInfo, prompt_len: int, inflight: int = 0,
              now: float | None = None) -> TtftTicket:
        """A call of a `prompt_len`-token prompt sent to `score`'s pod now, where this
        router has `inflight` other calls in flight."""
        now = time.perf_counter() if now is None else now
        clock = self._clock(score.pod_id)
        pod = pod_figures(info.tier_costs, info.load, info.pull_costs, score, self.costs,
                          clock.attention_per_prefill())
        self._overdue(clock, now)
        ahead = max(0.0, clock.busy_until() - now)
        if not clock.pending and info.updated_at > clock.last_first_token:
            ahead = max(ahead, backlog_seconds(pod))  # others' work, as the pod published it
        base = predict(score, prompt_len, pod, ahead)
        others_busy = any(c.pending for pid, c in self._clocks.items() if pid != score.pod_id)
        factor = clock.factor(others_busy)
        p = base if factor == 1.0 else TtftPrediction(
            base.ahead_s + base.own_s * factor, base.ahead_s, base.own_s * factor, base.steps)
        self._seq += 1
        ticket = TtftTicket(score.pod_id, self._seq, now, p.seconds, score.cost_s, p.ahead_s,
                            p.own_s, pod.step_s, now + p.seconds, others_busy=others_busy,
                            base_own_s=base.own_s)
        pairs = attention_pairs(score, prompt_len)
        if inflight == 0 and p.ahead_s == 0 and pod.measured and pairs >= ATTENTION_MIN_PAIRS \
                and not others_busy:
            ticket.attention = (base.own_s - pairs * pod.attention_s, pairs,
                                pod.prefill_s_per_token)
        ticket.measured_costs = pod.measured
        clock.pending.append(ticket)
        logger.debug("ttft %s #%d: %d-token prompt, %d cached, prefill %.3g s/token, step "
                     "%.3g s, attention %.3g s/pair, %d of ours pending", score.pod_id,
                     ticket.seq, prompt_len, score.cached_tokens, pod.prefill_s_per_token,
                     pod.step_s, pod.attention_s, len(clock.pending) - 1)
        return ticket

    def first_token(self, ticket: TtftTicket, now: float | None = None) -> None:
        """The call's first token arrived now (a stream's first chunk)."""
        now = time.perf_counter() if now is None else now
        self._measured(ticket, now)

    def unary_done(self, ticket: TtftTicket, steps: int, now: float | None = None) -> None:
        """A unary call answered now after `steps` generation steps: its first token came
        about steps - 1 of the pod's steps earlier."""
        now = time.perf_counter() if now is None else now
        first = max(ticket.sent, now - max(0, steps - 1) * ticket.step_s)
        self._measured(ticket, first)

    def close(self, ticket: TtftTicket | None) -> None:
        """The call ended without a measure (failed, stalled, moved on, cancelled): its
        work leaves the pod's clock."""
        if ticket is None or not ticket.open:
            return
        ticket.open = False
        self._drop(self._clock(ticket.pod_id), ticket, -ticket.own_s)

    @staticmethod
    def _overdue(clock: _PodClock, now: float) -> None:
        """The oldest pending call should have had its first token by now and has not: the
        pod is behind by at least that much, and every call queued behind it with it."""
        if not clock.pending:
            return
        late = now - clock.pending[0].expected_at
        if late > 0:
            for ticket in clock.pending:
                ticket.expected_at += late

    @staticmethod
    def _drop(clock: _PodClock, ticket: TtftTicket, shift: float) -> None:
        """Take `ticket` off the pending list; those sent after it move by `shift`."""
        after = False
        for other in clock.pending:
            if other is ticket:
                after = True
            elif after:
                other.expected_at += shift
        clock.pending.remove(ticket)

    def _measured(self, ticket: TtftTicket, first: float) -> None:
        if not ticket.open:
            return
        ticket.open = False
        clock = self._clock(ticket.pod_id)
        self._drop(clock, ticket, first - ticket.expected_at)
        clock.idle_at = max(clock.idle_at, first)
        clock.last_first_token = time.time()
        measured = first - ticket.sent
        if ticket.others_busy and ticket.ahead_s == 0 and ticket.measured_costs and \
                ticket.base_own_s > 0:
            clock.busy_ratios.append(measured / ticket.base_own_s)
        if ticket.attention is not None:
            rest, pairs, per_token = ticket.attention
            clock.attention.append((measured - rest) / (pairs * per_token))
        self._observe(ticket, measured)

    def _observe(self, ticket: TtftTicket, measured: float) -> None:
        m = self.metrics
        pod = ticket.pod_id
        m.ttft_seconds.labels(pod=pod).observe(measured)
        for predictor, predicted in zip(TTFT_PREDICTORS, (ticket.predicted_s, ticket.naive_s),
                                        strict=True):
            error, forgotten = self.errors.observe(pod, predictor, predicted, measured)
            for gone in forgotten:
                m.forget_ttft_pod(gone)
                self._clocks.pop(gone, None)
            if error is None:
                continue
            mape = self.errors.mape(pod, predictor)
            if mape is not None:
                m.ttft_mape.labels(pod=pod, predictor=predictor).set(mape)
            m.ttft_ratio.labels(pod=pod, predictor=predictor).observe(predicted / measured)
        logger.debug("ttft %s #%d: predicted %.4f s (%.4f ahead + %.4f own; cost_s %.4f), "
                     "measured %.4f s", pod, ticket.seq, ticket.predicted_s, ticket.ahead_s,
                     ticket.own_s, ticket.naive_s, measured)
