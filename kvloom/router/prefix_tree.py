"""An approximate radix tree of the text the router sent to each worker.

The router cannot see a worker's KV cache, so it remembers what it routed where: every
routed request's key (its prompt text) is inserted for the worker that got it, and a new
request goes preferably to the worker whose remembered text shares the longest prefix
with it (SGLang's router keeps the same kind of tree). It is character-level, not token
level: the router has no tokenizer, and a shared text prefix is a shared token prefix up
to the last token or so.

Invariants (``check_integrity``):

- a non-root node has a non-empty ``text`` and is its parent's child under ``text[0]``;
- every non-root node is held by at least one worker, and a worker holding a node holds
  its parent (a worker's remembered texts form a subtree from the root);
- a worker's ``last_access`` at a node is never later than at the node's parent (an
  insert touches the whole path at once), so the least recently used of its leaves is
  the right one to forget first;
- ``chars[worker]`` is the sum of ``len(text)`` over the nodes it holds, and stays at
  most ``max_chars_per_worker`` after every insert (LRU leaves are forgotten first).

Time is a counter of inserts, not the wall clock: the order is all that matters, and
tests are deterministic. Pure Python; one event loop uses it, so there are no locks.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field

# Eviction forgets down to this share of the bound, so that a full tree is walked once
# per tenth of its capacity inserted, not on every insert.
EVICT_TO = 0.9


@dataclass(slots=True, eq=False)
class _Node:
    text: str
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)
    # worker -> insert clock of the last request routed to it through this node
    last_access: dict[str, int] = field(default_factory=dict)


class PrefixTree:
    """Which workers were sent which text prefixes; bounded per worker, LRU eviction."""

    def __init__(self, max_chars_per_worker: int = 1_000_000) -> None:
        if max_chars_per_worker < 1:
            raise ValueError(f"max_chars_per_worker must be >= 1, got {max_chars_per_worker}")
        self.max_chars_per_worker = max_chars_per_worker
        self._root = _Node("", None)
        self._clock = 0
        self.chars: dict[str, int] = {}  # worker -> characters it holds in the tree

    # ---- queries -------------------------------------------------------------------------
    def match(self, text: str) -> dict[str, int]:
        """For each worker, how many leading characters of ``text`` it was sent (workers
        with no match are absent)."""
        matched: dict[str, int] = {}
        node, depth = self._root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                break
            common = _common_prefix_len(child.text, text, depth)
            # A worker holding `child` was sent text through at least `common` of its chars;
            # deeper nodes overwrite with longer matches (their holders hold this one too).
            for worker in child.last_access:
                matched[worker] = depth + common
            if common < len(child.text):
                break
            node, depth = child, depth + common
        return matched

    def workers(self) -> set[str]:
        return {w for w, n in self.chars.items() if n > 0}

    # ---- updates -------------------------------------------------------------------------
    def insert(self, text: str, worker: str) -> None:
        """Remember that ``text`` went to ``worker``; then forget ``worker``'s least
        recently used leaves while it holds more than ``max_chars_per_worker``."""
        self._clock += 1
        now = self._clock
        self.chars.setdefault(worker, 0)
        node, depth = self._root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                leaf = _Node(text[depth:], node, last_access={worker: now})
                node.children[leaf.text[0]] = leaf
                self.chars[worker] += len(leaf.text)
                break
            common = _common_prefix_len(child.text, text, depth)
            if common < len(child.text):
                child = self._split(child, common)
            if worker not in child.last_access:
                self.chars[worker] += len(child.text)
            child.last_access[worker] = now
            node, depth = child, depth + common
        if self.chars[worker] > self.max_chars_per_worker:
            self._evict(worker, int(self.max_chars_per_worker * EVICT_TO))

    def remove_worker(self, worker: str) -> None:
        """Forget everything sent to ``worker`` (it went down: its cache is gone)."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.last_access.pop(worker, None) is None:
                continue  # nor does any descendant hold it
            stack.extend(node.children.values())
            if not node.last_access:
                self._detach(node)
        self.chars.pop(worker, None)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s text at ``at``: a new parent holds the first part (held by the
        same workers, with the same times); sizes per worker do not change."""
        assert node.parent is not None and 0 < at < len(node.text)
        head = _Node(node.text[:at], node.parent, last_access=dict(node.last_access))
        node.parent.children[head.text[0]] = head
        node.text = node.text[at:]
        node.parent = head
        head.children[node.text[0]] = node
        return head

    def _evict(self, worker: str, target: int) -> None:
        # Leaves of `worker`: nodes it holds where no child is held by it. A min-heap on
        # time; a parent becomes a leaf once its last child of `worker` is forgotten.
        heap = [(n.last_access[worker], id(n), n) for n in self._nodes_of(worker)
                if not any(worker in c.last_access for c in n.children.values())]
        heapq.heapify(heap)
        while heap and self.chars[worker] > target:
            _, _, node = heapq.heappop(heap)
            del node.last_access[worker]
            self.chars[worker] -= len(node.text)
            parent = node.parent
            if not node.last_access:
                self._detach(node)
            if parent is not None and parent is not self._root and not any(
                    worker in c.last_access for c in parent.children.values()):
                heapq.heappush(heap, (parent.last_access[worker], id(parent), parent))

    def _detach(self, node: _Node) -> None:
        # Only when no worker holds it; then no worker holds its descendants either.
        assert node.parent is not None and not node.last_access
        del node.parent.children[node.text[0]]

    def _nodes_of(self, worker: str) -> list[_Node]:
        found: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if worker in node.last_access:
                found.append(node)
                stack.extend(node.children.values())
        return found

    # ---- checks --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant of the module docstring is broken."""
        sizes: dict[str, int] = {}
        stack = [self._root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.text and child.text[0] == key, (key, child.text)
                assert child.parent is node, "parent link broken"
                assert child.last_access, f"node {child.text[:20]!r} is held by no worker"
                for worker, time in child.last_access.items():
                    if node is not self._root:
                        assert worker in node.last_access, f"{worker} holds a node but not its parent"
                        assert time <= node.last_access[worker], f"{worker}: child newer than parent"
                    sizes[worker] = sizes.get(worker, 0) + len(child.text)
                stack.append(child)
        held = {w: n for w, n in self.chars.items() if n}
        assert sizes == held, (sizes, held)
        for worker, size in sizes.items():
            assert size <= self.max_chars_per_worker, (worker, size)


def _common_prefix_len(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[start:]``."""
    limit = min(len(edge), len(text) - start)
    # os.path.commonprefix compares in C; a Python loop over 4 KiB prompts is slow.
    return len(os.path.commonprefix([edge[:limit], text[start:start + limit]]))
