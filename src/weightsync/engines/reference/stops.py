"""Stop strings matched in time bounded by the longest one, not by how many there are.

The byte-level output ends with a stop string when a walk back from its last token, through a
trie of the stop strings written backwards, reaches the end of one: at most as many steps as
the longest stop string has bytes, whatever their number.  (Testing every stop string after
every token cost a request with a million of them seconds per step, and every other request
shares that step.)
"""

from __future__ import annotations

from collections.abc import Sequence

BYTE_TOKENS = 256
"""Token ids below this are bytes; any other token (a special one) ends a match."""


class _Node:
    __slots__ = ("children", "end")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.end: int | None = None  # the index of the first stop string ending here


class StopStrings:
    """The stop strings of one request.  :meth:`match` says which one the output now ends
    with: the first in the request's order when several do (as vLLM checks them)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._root = _Node()
        self._stops = tuple(stops)
        self.longest = 0
        for index, stop in enumerate(self._stops):
            raw = stop.encode("utf-8")
            self.longest = max(self.longest, len(raw))
            node = self._root
            for byte in reversed(raw):
                node = node.children.setdefault(byte, _Node())
            if node.end is None:
                node.end = index

    def __bool__(self) -> bool:
        return bool(self._stops)

    def match(self, out: Sequence[int]) -> str | None:
        """The stop string ``out`` ends with (bytes only, a special token breaks it), if any."""
        node: _Node | None = self._root
        best: int | None = None
        for step in range(1, min(self.longest, len(out)) + 1):
            token = out[-step]
            node = node.children.get(token) if token < BYTE_TOKENS and node is not None else None
            if node is None:
                break
            if node.end is not None and (best is None or node.end < best):
                best = node.end
        return None if best is None else self._stops[best]
