"""The memory manager: the block pool, per-request block tables, prefix caching. No torch."""
