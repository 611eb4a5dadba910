"""The chain's tree of the blocks below the pool, and the KV events that tell the index about it.

Every block below the pool has a node: its parent hash, token ids, LoRA id and the medium it
is in. The parent -> children links are what lets the chain drop a whole subtree once a block
has left every level: a prefix lookup stops at the first miss, so its descendants below the
pool could never be reached again. Each change to a node is published as a KV event
(BlockStored / BlockRemoved with its medium), drained by `take_events`, and reported to the
tenant ledger when there is one (whose blocks are in which tier: proto/tenant_ledger.py).

Not thread-safe: the chain's lock guards every call.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagekv.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagekv.proto.medium import OFFLOAD_MEDIUMS, Medium
from pagekv.proto.tenant_ledger import TenantLedger


@dataclass(slots=True)
class Node:
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    medium: Medium


class BlockTree:
    def __init__(self, block_size: int | None, ledger: TenantLedger | None = None) -> None:
        """`block_size` goes into BlockStored events (None: the token count of each block)."""
        self.block_size = block_size
        self.ledger = ledger
        self.nodes: dict[bytes, Node] = {}  # every block below the pool
        self.children: dict[bytes, set[bytes]] = {}  # parent -> children below the pool
        self._events: list[KVEvent] = []

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.nodes

    def get(self, block_hash: bytes) -> Node | None:
        return self.nodes.get(block_hash)

    def add(self, block_hash: bytes, node: Node) -> None:
        """A block arrived below the pool, in `node.medium`."""
        self.nodes[block_hash] = node
        if node.parent_hash is not None:
            self.children.setdefault(node.parent_hash, set()).add(block_hash)
        self._events.append(self._stored(block_hash, node))
        if self.ledger is not None:
            self.ledger.placed((block_hash,), node.medium)

    def moved(self, block_hash: bytes, node: Node, medium: Medium) -> None:
        """A block went from its tier to another one below the pool."""
        self._events.append(BlockRemoved([block_hash], medium=node.medium))
        if self.ledger is not None:
            self.ledger.placed((block_hash,), medium)
            self.ledger.gone((block_hash,), node.medium)
        node.medium = medium
        self._events.append(self._stored(block_hash, node))

    def left(self, block_hash: bytes, medium: Medium) -> None:
        """A block left `medium` and is below the pool no more (promoted, or lost)."""
        self._events.append(BlockRemoved([block_hash], medium=medium))
        self.forget(block_hash)

    def forget(self, block_hash: bytes) -> Node | None:
        """Unlink a block from the tree (its own children keep their link to it)."""
        node = self.nodes.pop(block_hash, None)
        if node is not None and self.ledger is not None:
            self.ledger.gone((block_hash,), node.medium)
        if node is not None and node.parent_hash is not None:
            siblings = self.children.get(node.parent_hash)
            if siblings is not None:
                siblings.discard(block_hash)
                if not siblings:
                    del self.children[node.parent_hash]
        return node

    def drop_descendants(self, block_hash: bytes) -> list[tuple[bytes, Medium]]:
        """`block_hash` left every level: unlink its descendants below the pool and publish
        their removal. Returns (hash, medium) of each, for the caller to take out of its tier."""
        stack = list(self.children.pop(block_hash, ()))
        dropped: list[tuple[bytes, Medium]] = []
        while stack:
            child = stack.pop()
            node = self.forget(child)
            if node is None:
                continue
            dropped.append((child, node.medium))
            stack.extend(self.children.pop(child, ()))
        for medium in OFFLOAD_MEDIUMS:
            hashes = [h for h, m in dropped if m == medium]
            if hashes:
                self._events.append(BlockRemoved(hashes, medium=medium))
        return dropped

    def cleared(self, media: tuple[Medium, ...]) -> None:
        """Every tier in `media` was emptied: the tree is empty."""
        self.nodes.clear()
        self.children.clear()
        self._events.extend(AllBlocksCleared(medium) for medium in media)
        if self.ledger is not None:
            for medium in media:
                self.ledger.cleared(medium)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _stored(self, block_hash: bytes, node: Node) -> BlockStored:
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=node.parent_hash,
            token_ids=list(node.token_ids),
            block_size=self.block_size if self.block_size is not None else len(node.token_ids),
            lora_id=node.lora_id,
            medium=node.medium,
        )
