"""Property test: random admit / decode / fork / free / reset sequences keep the invariants.

- every block's ref_cnt equals the number of request tables that reference it;
- the free queue's links are consistent both ways and hold exactly the ref_cnt == 0 blocks;
- the hash map only points at blocks carrying that hash;
- a lookup never hits past num_tokens - 1, and every hit is a true prefix of the request;
- a failed allocation touches nothing.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.kvnode.memory.request import Request
from tests.kv_invariants import check_lookup, check_manager

BS = 8
NUM_BLOCKS = 24
# A tiny alphabet of prompt prefixes so that random prompts share prefixes often.
PREFIXES = [[1] * 24, [2] * 8 + [3] * 16, list(range(40))]


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, watermark=0.0)
        self.running: dict[str, Request] = {}
        self.counter = 0
        # Content ground truth: which token sequence produced each cached hash.
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}

    def _new_id(self):
        self.counter += 1
        return f"r{self.counter}"

    def _snapshot(self):
        return [(b.ref_cnt, b.block_hash) for b in self.mgr.block_pool.blocks], [
            b.block_id for b in self.mgr.block_pool.free_block_queue.get_all_free_blocks()
        ]

    def _remember_hashes(self, req):
        for i, h in enumerate(req.block_hashes):
            toks = tuple(req.all_token_ids[: (i + 1) * BS])
            assert self.hash_tokens.setdefault(h, toks) == toks

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 50), max_size=20),
          cut=st.integers(1, 40))
    def admit(self, prefix, tail, cut):
        tokens = (prefix[:cut] + tail) or [0]
        req = Request(self._new_id(), tokens)
        check_lookup(self.mgr, req)
        hit = self.mgr.lookup(req)
        hits, n = hit.blocks, hit.num_tokens
        for i, b in enumerate(hits):  # a hit is the same content, not only the same hash
            assert b.block_hash == req.block_hashes[i]
            assert self.hash_tokens[b.block_hash] == tuple(req.all_token_ids[: (i + 1) * BS])
        before = self._snapshot()
        if self.mgr.allocate_slots(req, req.num_tokens - n, hit) is None:
            assert self._snapshot() == before
            return
        req.num_computed_tokens = req.num_tokens
        self._remember_hashes(req)
        self.running[req.request_id] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 50))
    def decode(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        req.append_output_token_ids(token)
        before = self._snapshot()
        if self.mgr.allocate_slots(req, 1) is None:
            assert self._snapshot() == before
            req.all_token_ids.pop()  # the step could not run: undo the sample
            req.output_token_ids.pop()
            del req.block_hashes[req.num_tokens // BS:]
            return
        req.num_computed_tokens += 1
        self._remember_hashes(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        parent = self.running[rid]
        child = Request(self._new_id(), parent.prompt_token_ids)
        child.all_token_ids = list(parent.all_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        self.mgr.fork(parent, child)
        assert child.block_hashes == parent.block_hashes
        self.running[child.request_id] = child

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.mgr.free(self.running.pop(rid))

    @rule()
    def reset(self):
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            self.hash_tokens.clear()

    @rule()
    def drain(self):
        self.mgr.take_events()
        self.mgr.take_block_copies()

    @invariant()
    def manager_consistent(self):
        check_manager(self.mgr)

    @invariant()
    def tables_cover_computed_tokens(self):
        for rid, req in self.running.items():
            blocks = self.mgr.req_to_blocks[rid]
            assert len(blocks) * BS >= req.num_computed_tokens
            assert req.block_hashes == req.block_hashes[: req.num_tokens // BS]
            assert len(req.block_hashes) == req.num_tokens // BS


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheInvariants = KVCacheMachine.TestCase
