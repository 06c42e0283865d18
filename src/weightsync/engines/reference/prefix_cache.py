"""The reference engine's block prefix cache, keyed by weight epoch.

A block is the K/V of ``BLOCK`` prompt tokens.  Its key is the weight epoch that computed
it and every token up to its end, so a request only ever reuses K/V computed by the weights
it runs on: an ``allow_unpaused`` update needs no cache reset, and blocks of older epochs
can never be hit again (they are dropped as soon as no request holds them).

This module keeps the bookkeeping (keys, reference counts, hits); the K/V itself lives
with the model, in a :class:`BlockStore`, under the integer id this cache gives each block,
so with tensor parallelism every rank keeps its own heads' share of a block under the same id.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

BLOCK = 16

# A prefix-cache key: the weight epoch that computed the block, the requests' cache salt ("" for
# none: vLLM's cache_salt), and the tokens it covers.
BlockKey = tuple[int, str, tuple[int, ...]]


class BlockStore(Protocol):
    """Where the K/V of cached blocks lives (the model runner)."""

    def save_block(self, block: int, slot: int, n: int) -> None:
        """Keep a copy of block ``n`` (positions ``n*BLOCK`` onwards) of ``slot``'s K/V as ``block``."""
        ...

    def load_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        """Write the kept ``blocks``, in order, at the start of ``slot``'s K/V."""
        ...

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Forget the kept ``blocks``."""
        ...


@attrs.define
class _CachedBlock:
    id: int
    refs: int = 0


class PrefixCache:
    """Which prompt prefixes have K/V kept in ``store``, and who holds them."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.hits = 0
        self._blocks: dict[BlockKey, _CachedBlock] = {}
        self._ids = itertools.count()

    def cached(self, epoch: int, tokens: Sequence[int], salt: str = "") -> bool:
        """Whether ``tokens`` would reuse a block computed under ``epoch`` for requests salted
        ``salt``: the first block is kept and the prompt is longer than it (one prompt token is
        always computed)."""
        return len(tokens) > BLOCK and (epoch, salt, tuple(tokens[:BLOCK])) in self._blocks

    def attach(
        self, epoch: int, prompt: Sequence[int], slot: int, held: list[BlockKey], salt: str = ""
    ) -> int:
        """Copy the longest prefix of ``prompt`` cached under ``epoch`` and ``salt`` into
        ``slot``; the keys it now holds are appended to ``held``.  Returns the number of tokens
        reused."""
        found = []
        n = 0
        while (n + 1) * BLOCK < len(prompt):  # keep at least one prompt token to compute
            key = (epoch, salt, tuple(prompt[: (n + 1) * BLOCK]))
            block = self._blocks.get(key)
            if block is None:
                break
            block.refs += 1
            held.append(key)
            found.append(block.id)
            n += 1
        if found:
            self.store.load_blocks(slot, found)
            self.hits += 1
        return n * BLOCK

    def store_prompt(
        self, epoch: int, prompt: Sequence[int], slot: int, held: list[BlockKey], salt: str = ""
    ) -> None:
        """Keep every whole block of ``prompt`` beyond the ``held`` ones from ``slot`` under
        ``salt``, and hold them."""
        for n in range(len(held), len(prompt) // BLOCK):
            key = (epoch, salt, tuple(prompt[: (n + 1) * BLOCK]))
            if key not in self._blocks:
                block = _CachedBlock(next(self._ids))
                self.store.save_block(block.id, slot, n)
                self._blocks[key] = block
            self._blocks[key].refs += 1
            held.append(key)

    def release(self, held: list[BlockKey], epoch: int) -> None:
        """A request that held ``held`` is done with them (emptied); blocks of epochs other
        than ``epoch`` (the served one) that nobody holds any more are dropped."""
        dropped = []
        for key in held:
            block = self._blocks.get(key)
            if block is not None:
                block.refs -= 1
                if not block.refs and key[0] != epoch:
                    dropped.append(self._blocks.pop(key).id)  # computed by weights no longer served
        held.clear()
        if dropped:
            self.store.free_blocks(dropped)

    def epoch_changed(self, epoch: int) -> None:
        """The served weights are now ``epoch``: drop the older blocks nobody holds (the held
        ones go when their requests finish)."""
        stale = [k for k, b in self._blocks.items() if not b.refs and k[0] != epoch]
        if stale:
            self.store.free_blocks([self._blocks.pop(k).id for k in stale])

    def clear(self) -> None:
        """Drop every block, held or not (the holders must stop using them)."""
        if self._blocks:
            self.store.free_blocks([b.id for b in self._blocks.values()])
        self._blocks.clear()

    def stats(self) -> dict[str, Any]:
        held = sum(1 for b in self._blocks.values() if b.refs)
        return {"blocks": len(self._blocks), "held": held, "hits": self.hits}
