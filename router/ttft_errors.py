"""The TTFT predictors' recent error per pod: a rolling mean absolute percentage error.

Each measured first token gives, per predictor ("model": router/ttft_model.py; "cost_s":
the scorer's cost, the naive baseline), one |predicted - measured| / measured; a pod's MAPE
is the mean over its last `window` of them. A window, not a lifetime mean: pods' speeds and
loads change, and a gauge should say how good the predictions are now. Bounded: `window`
errors per (pod, predictor), for at most `max_pods` pods, the least recently observed one
forgotten first (its gauge series removed by the caller through `observe`'s return).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from pagekv.router.ttft_model import absolute_percentage_error


class RollingErrors:
    def __init__(self, window: int = 100, max_pods: int = 1024) -> None:
        if window < 1 or max_pods < 1:
            raise ValueError(f"window and max_pods must be >= 1, got {window}, {max_pods}")
        self.window = window
        self.max_pods = max_pods
        # pod -> predictor -> its recent errors
        self._errors: OrderedDict[str, dict[str, deque[float]]] = OrderedDict()

    def observe(self, pod: str, predictor: str, predicted_s: float, measured_s: float
                ) -> tuple[float | None, list[str]]:
        """Note one prediction against its measure; returns (the error, None when it could
        not be computed; the pods forgotten to make room)."""
        error = absolute_percentage_error(predicted_s, measured_s)
        if error is None:
            return None, []
        per = self._errors.get(pod)
        forgotten: list[str] = []
        if per is None:
            per = self._errors[pod] = {}
            while len(self._errors) > self.max_pods:
                gone, _ = self._errors.popitem(last=False)
                forgotten.append(gone)
        self._errors.move_to_end(pod)
        errors = per.get(predictor)
        if errors is None:
            errors = per[predictor] = deque(maxlen=self.window)
        errors.append(error)
        return error, forgotten

    def mape(self, pod: str, predictor: str) -> float | None:
        """The mean of the pod's last `window` errors (a fraction: 0.15 is 15%)."""
        errors = self._errors.get(pod, {}).get(predictor)
        if not errors:
            return None
        return sum(errors) / len(errors)

    def count(self, pod: str, predictor: str) -> int:
        return len(self._errors.get(pod, {}).get(predictor, ()))
