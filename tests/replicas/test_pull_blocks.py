"""A pull's bookkeeping on both prefix caches (replicas/prefill/pull.py: `reserve_pull`, `borrow_chain`,
`land_pull`), against a model: prompts computed on a holder and a receiver, pulls started, landed whole
or failed (holder killed, link lost) in any order, evictions on both sides meanwhile. A lent block is
never evicted while it moves, what lands joins the receiver's cache under the key whose KV it holds,
and once every pull ended every block is the cache's or free."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replicas.prefill.pull import borrow_chain, land_pull, reserve_pull
from transport.memory.blocks import BlockPool
from transport.memory.prefix_cache import CACHE_OWNER, PrefixCache, block_keys

MODEL = b"test-model"
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=6)  # block size 1: one key per token


class _Side:
    """One replica: its pool, its cache, and what each block holds (the key whose KV was written)."""

    def __init__(self, blocks: int) -> None:
        self.pool = BlockPool(blocks, 1)
        self.cache = PrefixCache(self.pool)
        self.content: dict[int, bytes] = {}

    def compute(self, owner: str, keys: list[bytes]) -> None:
        """A prompt runs here: borrow its cached prefix, compute the rest, cache it, end."""
        borrowed = self.cache.acquire(owner, keys, limit=len(keys))
        rest = self.pool.try_allocate(len(keys) - len(borrowed), owner)
        if rest is None:
            self.cache.release(owner, borrowed)
            return
        for block, key in zip(rest, keys[len(borrowed) :], strict=True):
            self.content[block] = key
        table = borrowed + rest
        self.cache.publish(owner, table)
        self.cache.release(owner, table)

    def check_chain(self, keys: list[bytes]) -> None:
        """Every cached block of `keys`' chain holds its key's KV."""
        blocks = self.cache.acquire("probe", keys, limit=len(keys))
        assert [self.content[b] for b in blocks] == keys[: len(blocks)]
        self.cache.release("probe", blocks)


class PullMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.holder = _Side(10)
        self.receiver = _Side(8)
        self.serial = 0
        # owner -> (keys, own, landing, lend owner, lent blocks, sending)
        self.pulls: dict[str, tuple[list[bytes], list[int], list[int], str, list[int], list[int]]] = {}
        self.seen: list[list[bytes]] = []
        self.computed: list[list[int]] = []  # the holder's prompts

    def _owner(self) -> str:
        self.serial += 1
        return f"r{self.serial}"

    @rule(tokens=PROMPTS, on_receiver=st.booleans())
    def compute(self, tokens: list[int], on_receiver: bool) -> None:
        keys = block_keys(MODEL, tokens, 1)
        self.seen.append(keys)
        on_holder = not on_receiver
        if on_holder:
            self.computed.append(tokens)
        (self.holder if on_holder else self.receiver).compute(self._owner(), keys)

    @rule(base=st.integers(0, 3), tokens=PROMPTS, limit=st.integers(1, 8))
    def start_pull(self, base: int, tokens: list[int], limit: int) -> None:
        """A prompt that often begins with one the holder computed (`base`: the latest ones)."""
        if base < len(self.computed):
            tokens = self.computed[-1 - base] + tokens
        keys = block_keys(MODEL, tokens, 1)
        self.seen.append(keys)
        owner = self._owner()
        reserved = reserve_pull(self.receiver.cache, owner, keys, min(limit, len(keys)))
        if reserved is None:
            assert self.receiver.cache.borrowings().get(owner, 0) == 0
            return
        own, landing = reserved
        assert self.receiver.cache.match(keys) >= len(own)
        lender = f"lend:{owner}"
        lent, sending = borrow_chain(self.holder.cache, lender, keys[: len(own) + len(landing)], len(own))
        self.pulls[owner] = (keys, own, landing, lender, lent, sending)

    @rule(blocks=st.integers(1, 2))
    def evict_holder(self, blocks: int) -> None:
        self.holder.cache.evict(blocks)

    @rule(blocks=st.integers(1, 2))
    def evict_receiver(self, blocks: int) -> None:
        self.receiver.cache.evict(blocks)

    @precondition(lambda self: bool(self.pulls))
    @rule(data=st.data(), failed=st.booleans())
    def end_pull(self, data: st.DataObject, failed: bool) -> None:
        """The transfer ends: every block it sent landed, or it `failed` (nothing counts)."""
        owner = data.draw(st.sampled_from(sorted(self.pulls)))
        keys, own, landing, lender, lent, sending = self.pulls.pop(owner)
        landed = 0 if failed else min(len(sending), len(landing))
        for target, source in zip(landing[:landed], sending[:landed], strict=True):
            self.receiver.content[target] = self.holder.content[source]  # the bytes that moved
        if lent:
            self.holder.cache.release(lender, lent)
        table = land_pull(self.receiver.cache, owner, own, landing, landed)
        assert [self.receiver.content[b] for b in table] == keys[: len(table)]
        held = set(self.receiver.pool.owned_by(owner)) | set(self.receiver.pool.owned_by(CACHE_OWNER))
        assert set(table) <= held  # the prompt would run after them; this one just ends
        self.receiver.cache.release(owner, table)

    @invariant()
    def consistent(self) -> None:
        for side in (self.holder, self.receiver):
            side.cache.check_invariants()
            side.pool.check_invariants()
        cached = set(self.holder.pool.owned_by(CACHE_OWNER))
        for _, _, _, _, lent, sending in self.pulls.values():
            assert set(lent) <= cached and sending == lent[len(lent) - len(sending) :]  # not evicted
        for keys in self.seen[-4:]:
            self.holder.check_chain(keys)
            self.receiver.check_chain(keys)

    def teardown(self) -> None:
        for owner in list(self.pulls):
            _, own, landing, lender, lent, _ = self.pulls.pop(owner)
            if lent:
                self.holder.cache.release(lender, lent)
            self.receiver.cache.release(owner, land_pull(self.receiver.cache, owner, own, landing, 0))
        for side in (self.holder, self.receiver):
            assert set(side.pool.owners()) <= {CACHE_OWNER}
            assert side.cache.borrowings() == {}


PullMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_pull_bookkeeping = PullMachine.TestCase
