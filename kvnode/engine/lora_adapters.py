"""The pod's LoRA adapters: those it knows (name -> directory) and those resident in its slots.

`--lora-modules name=path ...` names adapters at start (each read in full then: a bad one
stops the start in one line); `/v1/load_lora_adapter` adds one at run time (read in full off
the engine thread before it is known: a bad file is one clear error and the pod keeps
serving) and `/v1/unload_lora_adapter` removes one. At most `--max-loras` are resident at
once, the least recently used out, never one a running request uses. A request for an
adapter that is not resident waits in the queue (not scheduled; others are) while the
loader thread reads it — a load never runs on the engine thread — and if that load fails,
the requests waiting on it fail with its one-line reason.

Adapter names enter the hash with their path (proto/hashing.py, vLLM's ("lora", name, path)),
so two pods serving one adapter under one name and path share an index, and an adapter's
blocks are never the base model's or another adapter's.

The engine thread calls `ready` / `poll`; the servers' threads call `register`,
`unregister`, `path_of` and `names` (under the lock).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pagekv.kvnode.model.lora import AdapterError, LoraWeights, read_adapter_config
from pagekv.proto.requests import MAX_ADAPTER_NAME, NoSuchAdapter, unknown_adapter

logger = logging.getLogger(__name__)

Loader = Callable[[str, str], LoraWeights]  # (name, path) -> weights; AdapterError
MAX_LABELS = 32  # adapters with their own metric label; the rest count as OTHER_LABEL
OTHER_LABEL = "_other"


class AdapterUnavailable(RuntimeError):
    """The adapter is known but its last load failed (FAILED_PRECONDITION / 503)."""


@dataclass(frozen=True, slots=True)
class AdapterStats:
    known: int
    resident: tuple[str, ...]
    loads: int
    evictions: int
    load_failures: int
    last_load_s: float | None
    load_seconds_total: float
    # per adapter label (bounded: MAX_LABELS names, then "_other"): requests finished,
    # their prompt tokens and the cached ones
    requests: dict[str, int]
    prompt_tokens: dict[str, int]
    cached_tokens: dict[str, int]


def parse_lora_modules(entries: Iterable[str]) -> dict[str, str]:
    """vLLM's `--lora-modules` entries: `name=path` or JSON `{"name": ..., "path": ...}`."""
    out: dict[str, str] = {}
    for entry in entries:
        entry = entry.strip()
        if entry.startswith("{"):
            try:
                spec = json.loads(entry)
            except json.JSONDecodeError as exc:
                raise AdapterError(f"--lora-modules {entry!r}: not JSON ({exc.msg})") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                    not isinstance(spec.get("path"), str):
                raise AdapterError(f"--lora-modules {entry!r}: JSON needs \"name\" and "
                                   "\"path\" strings")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise AdapterError(f"--lora-modules {entry!r}: expected name=path")
        if name in out:
            raise AdapterError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def check_name(name: str) -> str:
    if not name or len(name) > MAX_ADAPTER_NAME or not name.isprintable() or "=" in name:
        raise AdapterError(f"adapter name {name[:MAX_ADAPTER_NAME]!r}: 1 to {MAX_ADAPTER_NAME} printable "
                           "characters, no '='")
    return name


class AdapterSlots:
    def __init__(self, max_loras: int, loader: Loader, busy: Callable[[], set[str]]) -> None:
        """`busy`: the adapters running requests use (never evicted)."""
        if max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._loader = loader
        self._busy = busy
        self._known: dict[str, str] = {}
        self._lock = threading.Lock()
        self.resident: OrderedDict[str, LoraWeights] = OrderedDict()  # LRU first
        self._resident_names: tuple[str, ...] = ()  # a copy other threads may read
        self._loading: dict[str, tuple[Future[LoraWeights], float]] = {}
        self.failed: dict[str, str] = {}  # name -> why its last load failed
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.loads = self.evictions = self.load_failures = 0
        self.load_seconds_total = 0.0
        self.last_load_s: float | None = None  # a load's measured cost, for the router
        self._requests: dict[str, list[int]] = {}  # label -> [requests, prompt, cached]

    # --- names (any thread) --------------------------------------------------------------
    def register(self, name: str, path: str, weights: LoraWeights | None = None) -> None:
        """Know an adapter: its config is read now (AdapterError if it cannot be served);
        `weights` read in full already (a run-time load) go to a free slot if there is one."""
        check_name(name)
        read_adapter_config(path)
        with self._lock:
            old = self._known.get(name)
            if old is not None and old != path:
                raise AdapterError(f"adapter {name!r} is already loaded from {old}; unload it "
                                   "first")
            self._known[name] = path
            self.failed.pop(name, None)
            if weights is not None and name not in self.resident and \
                    len(self.resident) + len(self._loading) < self.max_loras:
                self.resident[name] = weights
                self._resident_names = tuple(self.resident)

    def unregister(self, name: str) -> None:
        """Forget an adapter; NoSuchAdapter. Requests using it finish with it first: its
        weights stay resident only until they do."""
        with self._lock:
            if self._known.pop(name, None) is None:
                raise NoSuchAdapter(name)
            self.failed.pop(name, None)

    def knows(self, name: str) -> bool:
        return name in self._known

    def path_of(self, name: str) -> str:
        """The adapter's directory; NoSuchAdapter."""
        path = self._known.get(name)
        if path is None:
            raise NoSuchAdapter(name)
        return path

    def names(self) -> dict[str, str]:
        with self._lock:
            return dict(self._known)

    # --- residency (engine thread) -------------------------------------------------------
    def ready(self, name: str) -> LoraWeights | None:
        """The adapter's weights if resident (it becomes the most recent); else None, its
        load started when a slot can be had (every slot busy: it waits for one)."""
        self.poll()
        weights = self.resident.get(name)
        if weights is not None:
            self.resident.move_to_end(name)
            return weights
        path = self._known.get(name)
        if path is None:  # unloaded while its request waited: that request fails (NOT_FOUND)
            self.failed.setdefault(name, unknown_adapter(name))
            return None
        if name in self._loading or name in self.failed:
            return None
        if len(self.resident) + len(self._loading) >= self.max_loras and not self._evict_one():
            return None
        self._loading[name] = (self._pool.submit(self._loader, name, path), time.monotonic())
        logger.info("lora: loading adapter %s from %s", name, path)
        return None

    def resident_weights(self, name: str) -> LoraWeights:
        """A running request's adapter (resident while it runs)."""
        return self.resident[name]

    def poll(self) -> None:
        """Collect finished loads."""
        for name, (future, started) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[name]
            seconds = time.monotonic() - started
            try:
                weights = future.result()
            except Exception as exc:  # the reason reaches the requests waiting on it
                self.load_failures += 1
                why = str(exc) if isinstance(exc, AdapterError) else \
                    f"adapter {name}: load failed: {exc!r}"
                self.failed[name] = why
                logger.error("lora: %s", why)
                continue
            if name not in self._known:  # unloaded meanwhile
                continue
            self.resident[name] = weights
            self.loads += 1
            self.last_load_s = seconds
            self.load_seconds_total += seconds
            logger.info("lora: adapter %s resident (rank %d, %s; %.1f MiB) in %.3f s", name,
                        weights.rank, "+".join(weights.targets), weights.nbytes / 2**20,
                        seconds)
        # An unloaded adapter's weights leave once no running request uses them.
        for name in [n for n in self.resident if n not in self._known]:
            if name not in self._busy():
                del self.resident[name]
        self._resident_names = tuple(self.resident)

    def snapshot(self) -> tuple[dict[str, str], tuple[str, ...], float | None]:
        """Any thread: (name -> path of every known adapter, the resident ones, the last
        load's seconds), what the pod publishes."""
        with self._lock:
            return dict(self._known), self._resident_names, self.last_load_s

    def has_loading(self) -> bool:
        return bool(self._loading)

    def note_request(self, name: str, prompt_tokens: int, cached_tokens: int) -> None:
        """Engine thread: a request of adapter `name` finished."""
        label = name if name in self._requests or len(self._requests) < MAX_LABELS \
            else OTHER_LABEL
        counts = self._requests.setdefault(label, [0, 0, 0])
        counts[0] += 1
        counts[1] += prompt_tokens
        counts[2] += cached_tokens

    def stats(self) -> AdapterStats:
        counts = {label: list(c) for label, c in list(self._requests.items())}
        return AdapterStats(len(self._known), self._resident_names, self.loads, self.evictions,
                            self.load_failures, self.last_load_s, self.load_seconds_total,
                            {k: c[0] for k, c in counts.items()},
                            {k: c[1] for k, c in counts.items()},
                            {k: c[2] for k, c in counts.items()})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _evict_one(self) -> bool:
        busy = self._busy()
        for name in self.resident:
            if name not in busy:
                del self.resident[name]
                self._resident_names = tuple(self.resident)
                self.evictions += 1
                logger.info("lora: adapter %s evicted from its slot (least recently used)",
                            name)
                return True
        return False
