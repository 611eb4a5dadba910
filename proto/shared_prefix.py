"""The shared region: the leading blocks of a prompt that every tenant may hit.

Tenants never share cached blocks: the salt derived from a tenant's name is in its first
block's hash, so every later hash differs too (proto/tenant_salt.py). A common system prompt
would then be computed and cached once per tenant. The tenants file's `shared:` names such
prefixes (public text: whoever sends it hits it); a prompt whose first k full blocks lie
within one of them hashes those k blocks without its salt and puts the salt on block k
(`RequestBlockHasher(salt_block=k)`), so the shared blocks are the same for all and what
follows stays the tenant's. The router and the pods find the same k from the same file and
tokenizer, so the router's predictions and a peer's pull check hash as the pod does.

The router imports this module: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagekv.proto.tenants import SharedRegion


class SharedPrefixes:
    def __init__(self, prefixes: Sequence[Sequence[int]], block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        # Whole blocks only: a partial last block is never shared (it is never a cache entry).
        self._prefixes = [list(p[: len(p) // block_size * block_size]) for p in prefixes]
        self._prefixes = [p for p in self._prefixes if p]
        self.num_tokens = sum(map(len, self._prefixes))

    @classmethod
    def of(cls, region: SharedRegion | None, encode: Callable[[str], Sequence[int]],
           block_size: int) -> SharedPrefixes | None:
        """The region's prefixes as token ids (texts tokenized with `encode`, the prompts'
        own tokenizer); None without a region."""
        if region is None:
            return None
        ids = [list(encode(text)) for text in region.texts] + [list(t) for t in region.token_ids]
        return cls(ids, block_size)

    def __len__(self) -> int:
        return len(self._prefixes)

    def blocks(self, token_ids: Sequence[int]) -> int:
        """How many of the prompt's leading full blocks lie within one shared prefix (the
        longest match over all of them)."""
        bs = self.block_size
        best = 0
        for prefix in self._prefixes:
            if list(token_ids[:bs]) != prefix[:bs]:
                continue  # (most prompts: one slice compare per prefix)
            n = min(len(prefix), len(token_ids)) // bs
            k = 1
            while k < n and list(token_ids[k * bs:(k + 1) * bs]) == prefix[k * bs:(k + 1) * bs]:
                k += 1
            best = max(best, k)
        return best
