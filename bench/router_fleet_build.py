"""bench.router_fleet's synthetic fleet: chains of blocks on shared roots, held by pods, and
the requests that read them (issue #30's fleet).

* `chains` chains of `chain_blocks` blocks (16 tokens each), on `roots` roots: the chains of
  one root share its first `root_blocks` blocks (the same tokens, so the same hashes);
* each chain held whole by 1-4 pods (seeded); a pod holding two chains of one root holds
  their shared blocks once, so the claims are the distinct (block, pod) pairs;
* `requests` requests, each the first 1..len blocks of a chain plus a random tail of tokens
  (never a whole block of anything held).

The tokens and the requests depend on the seed only, the holders on the seed and the pod
count, so that every pod count reads the same requests. Each pod's state is published as
the pod would: per chain one BlockStored of the blocks it did not hold yet, linked to its
parent (`Run`). `depths` is the oracle: how many leading blocks of a request each pod holds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagekv.proto.hashing import HashConfig, RequestBlockHasher, max_hit_blocks


@dataclass(frozen=True)
class FleetConfig:
    chains: int = 200
    roots: int = 20
    chain_blocks: tuple[int, int] = (32, 128)
    root_blocks: tuple[int, int] = (8, 24)  # shared by a root's chains (< chain_blocks[0])
    holders: tuple[int, int] = (1, 4)
    requests: int = 2000
    tail_tokens: tuple[int, int] = (1, 256)
    block_size: int = 16
    vocab: int = 32_000
    seed: int = 0
    hash_algo: str = "sha256"
    hash_seed: str = "vllm-none-hash"


@dataclass(frozen=True, slots=True)
class Run:
    """One BlockStored: `hashes` stored after `parent` (None: from the chain's start)."""

    chain: int
    start: int  # the first block's index in the chain
    hashes: list[bytes]
    parent: bytes | None
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class FleetRequest:
    chain: int
    prefix_blocks: int  # the chain's blocks it starts with
    tokens: list[int]


@dataclass
class Fleet:
    config: FleetConfig
    pods: list[str]
    chain_tokens: list[list[int]]
    chain_hashes: list[list[bytes]]
    chain_root: list[int]
    holders: list[list[int]]  # per chain, the pods (indices) that hold it
    runs: list[list[Run]]  # per pod, its BlockStored events in order
    held: list[set[bytes]]  # per pod
    requests: list[FleetRequest]
    holders_of: dict[bytes, list[int]] = field(default_factory=dict)  # block -> pods

    @property
    def claims(self) -> int:
        return sum(len(h) for h in self.held)

    @property
    def distinct_blocks(self) -> int:
        return len(self.holders_of)

    def depths(self, request: FleetRequest) -> dict[int, int]:
        """Pod index -> the leading blocks of `request` it holds (pods holding none left
        out), up to the blocks a prompt of its length can hit."""
        hashes = self.chain_hashes[request.chain]
        limit = min(request.prefix_blocks,
                    max_hit_blocks(len(request.tokens), self.config.block_size))
        out: dict[int, int] = {}
        for pod in self.holders_of.get(hashes[0], ()) if limit else ():
            held, d = self.held[pod], 0
            while d < limit and hashes[d] in held:
                d += 1
            out[pod] = d
        return out

    def best_depth(self, request: FleetRequest) -> int:
        return max(self.depths(request).values(), default=0)


def _span(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def build_fleet(n_pods: int, config: FleetConfig = FleetConfig()) -> Fleet:
    c = config
    if c.root_blocks[1] >= c.chain_blocks[0]:
        raise ValueError("a root's shared blocks must be fewer than a chain's")
    bs = c.block_size
    tok = random.Random(c.seed)
    root_tokens = [[tok.randrange(c.vocab) for _ in range(_span(tok, c.root_blocks) * bs)]
                   for _ in range(c.roots)]
    chain_root = [i % c.roots for i in range(c.chains)]
    chain_tokens = []
    for i in range(c.chains):
        root = root_tokens[chain_root[i]]
        own = _span(tok, c.chain_blocks) * bs - len(root)
        chain_tokens.append(root + [tok.randrange(c.vocab) for _ in range(own)])
    hash_config = HashConfig(c.hash_algo, c.hash_seed)
    chain_hashes = []
    for tokens in chain_tokens:
        hashes: list[bytes] = []
        RequestBlockHasher(hash_config, bs).extend(tokens, hashes)
        chain_hashes.append(hashes)

    pick = random.Random(f"{c.seed}-holders-{n_pods}")
    holders = [sorted(pick.sample(range(n_pods), min(n_pods, _span(pick, c.holders))))
               for _ in range(c.chains)]
    runs: list[list[Run]] = [[] for _ in range(n_pods)]
    held: list[set[bytes]] = [set() for _ in range(n_pods)]
    holders_of: dict[bytes, list[int]] = {}
    for chain, pods in enumerate(holders):
        hashes = chain_hashes[chain]
        for pod in pods:
            have = held[pod]
            start = 0
            while start < len(hashes) and hashes[start] in have:
                start += 1  # the root's blocks another of its chains brought
            if start == len(hashes):
                continue
            runs[pod].append(Run(chain, start, hashes[start:],
                                 hashes[start - 1] if start else None,
                                 chain_tokens[chain][start * bs:]))
            for h in hashes[start:]:
                have.add(h)
                holders_of.setdefault(h, []).append(pod)

    ask = random.Random(f"{c.seed}-requests")
    requests = []
    for _ in range(c.requests):
        chain = ask.randrange(c.chains)
        prefix = ask.randint(1, len(chain_hashes[chain]))
        tail = [ask.randrange(c.vocab) for _ in range(_span(ask, c.tail_tokens))]
        requests.append(FleetRequest(chain, prefix, chain_tokens[chain][:prefix * bs] + tail))
    return Fleet(c, [f"pod-{i:04d}" for i in range(n_pods)], chain_tokens, chain_hashes,
                 chain_root, holders, runs, held, requests, holders_of)
