"""A generation request as the KV cache manager sees it: its tokens and their block hashes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagekv.proto.retention import NO_CACHE_CONTROL, CacheControl

if TYPE_CHECKING:
    from pagekv.proto.hashing import RequestBlockHasher

MMInput = tuple[str, int, int]  # (identifier, first token position, length in tokens)


def _check_token_ids(token_ids: Sequence[int], what: str) -> list[int]:
    out = list(token_ids)
    for t in out:
        # bool is an int subclass but never a token id.
        if type(t) is not int or t < 0:
            raise ValueError(f"{what} must be non-negative ints, got {t!r}")
    return out


class Request:
    """Token ids (prompt + output), how many are computed, and the chained block hashes.

    `block_hashes` holds one hash per *full* block of `all_token_ids`, kept current by the
    request hasher that the KV cache manager attaches; only new full blocks are hashed.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "cache_salt",
        "lora_id",
        "lora_path",
        "mm_inputs",
        "all_token_ids",
        "output_token_ids",
        "num_computed_tokens",
        "block_hashes",
        "hasher",
        "prefix_stats_recorded",
        "cache_control",
        "num_hit_blocks",
        "tenant",
        "shared_blocks",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_id: str | None = None,
        mm_hashes: Sequence[MMInput] = (),
        lora_path: str | None = None,
        cache_control: CacheControl = NO_CACHE_CONTROL,
        tenant: str = "",
        shared_blocks: int = 0,
    ) -> None:
        """`tenant`: whose quota its cached blocks count against ("": no tenant);
        `shared_blocks`: its leading blocks in the shared region (proto/shared_prefix.py),
        hashed without its salt."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        self.request_id = request_id
        self.prompt_token_ids = _check_token_ids(prompt_token_ids, "prompt token ids")
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.cache_salt = cache_salt or None
        self.lora_id = lora_id or None
        self.lora_path = lora_path
        self.mm_inputs = tuple(mm_hashes)
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.hasher: RequestBlockHasher | None = None
        self.prefix_stats_recorded = False
        self.cache_control = cache_control  # pin, one-shot, session (proto/retention.py)
        self.num_hit_blocks = 0  # its prefix hit at admission: the blocks it did not compute
        self.tenant = tenant
        self.shared_blocks = shared_blocks

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if type(token_ids) is int and token_ids >= 0:  # a decode step's one token
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            new = [token_ids] if isinstance(token_ids, int) else token_ids
            new = _check_token_ids(new, "output token ids")
            self.output_token_ids.extend(new)
            self.all_token_ids.extend(new)
        hasher = self.hasher
        # Hash only when a block became full: the test `extend` starts with, without its
        # call on every decoded token.
        if hasher is not None and len(self.all_token_ids) // hasher.block_size > len(
            self.block_hashes
        ):
            hasher.extend(self.all_token_ids, self.block_hashes)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, hashes={len(self.block_hashes)})"
        )
