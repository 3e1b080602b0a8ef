"""Suffix drafting (`method: "suffix"`, the idea of Arctic Inference's suffix decoding): the draft is the most
frequent continuation of the longest suffix of a request's tokens seen before, in its own prompt and output or
in recent requests' outputs.

`SuffixTrie` holds every substring of length up to `depth` of the sequences put into it, each node counting
the occurrences of its substring and how many of them a token follows. Growing a sequence by a token extends
the nodes of its last `depth - 1` suffixes by one child each (O(depth), nothing rebuilt), so a trie holds at
most `depth` nodes per token. Nodes live in flat integer arrays, their edges in one dict keyed by
(parent, token).

`SuffixProposer` keeps a trie per request (its prompt, then its output as it grows) together with the nodes of
the request's current suffixes, and one cross-request trie of the outputs of the last
`suffix_decoding_max_cached_requests` finished requests (the least recently finished leaves first, its counts
taken back). A draft starts at the longest current suffix that some earlier occurrence continues, follows the
most frequent child while the product of the children's shares (count over the parent's continued count) stays
at or above `suffix_decoding_min_token_prob`, and is at most `suffix_decoding_max_spec_factor` times the
match's length, `num_speculative_tokens` and the step's room: a long confident match proposes many tokens, a
short or ambiguous one few. Of the request's own trie and the cross-request one, the draft with the higher
expected number of accepted tokens (the sum of those products) wins; a tie goes to the request's own.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridserve.engine.drafting import unseen
from hybridserve.speculative import SpeculativeConfig

_ROOT = 0
_KEY = 1 << 32  # an edge's key: parent * _KEY + token


class SuffixTrie:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._edges: dict[int, int] = {}
        self._token = array("i", [-1])
        self._count = array("i", [0])  # occurrences of the node's substring
        self._total = array("i", [0])  # of which a token follows: the sum of the children's counts
        self._first = array("i", [-1])  # its first child (the most recently made)
        self._next = array("i", [-1])  # its next sibling
        self._free: list[int] = []  # slots of removed nodes, made again first

    @property
    def num_nodes(self) -> int:
        """The root included."""
        return len(self._token) - len(self._free)

    def extend(self, suffixes: list[int], token: int) -> list[int]:
        """`suffixes` are the nodes of a sequence's last suffixes, of lengths 1, 2, ... (depth - 1 at most):
        counts the sequence grown by `token`; returns the grown sequence's suffixes."""
        grown = []
        edges, count, total = self._edges, self._count, self._total
        for parent in (_ROOT, *suffixes):
            child = edges.get(parent * _KEY + token)
            if child is None:
                child = self._make(parent, token)
            count[child] += 1
            total[parent] += 1
            grown.append(child)
        del grown[self.depth - 1 :]
        return grown

    def insert(self, tokens: Sequence[int]) -> None:
        suffixes: list[int] = []
        for token in tokens:
            suffixes = self.extend(suffixes, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `insert(tokens)`: nodes no other sequence holds are freed."""
        for start in range(len(tokens)):
            path, node = [], _ROOT
            for token in tokens[start : start + self.depth]:
                child = self._edges[node * _KEY + token]
                path.append((node, child))
                node = child
            for parent, child in reversed(path):  # deepest first: a node is freed after its children
                self._count[child] -= 1
                self._total[parent] -= 1
                if not self._count[child]:
                    self._unmake(parent, child)

    def find(self, tokens: Sequence[int]) -> int | None:
        """The node of `tokens`, or None where they never occurred."""
        node: int | None = _ROOT
        for token in tokens:
            node = self._edges.get(node * _KEY + token)
            if node is None:
                return None
        return node

    def child(self, node: int, token: int) -> int | None:
        return self._edges.get(node * _KEY + token)

    def continued(self, node: int) -> int:
        """How many occurrences of the node's substring a token follows."""
        return self._total[node]

    def follow(self, node: int, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation of `node` (ties: the child made last), at most `max_tokens` long and
        while its estimated probability stays at or above `min_prob`; with the sum of those probabilities."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < max_tokens and self._total[node]:
            best = child = self._first[node]
            while child != -1:
                if self._count[child] > self._count[best]:
                    best = child
                child = self._next[child]
            prob *= self._count[best] / self._total[node]
            if prob < min_prob:
                break
            draft.append(self._token[best])
            score += prob
            node = best
        return draft, score

    def _make(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self._token[node], self._count[node], self._total[node] = token, 0, 0
            self._first[node], self._next[node] = -1, self._first[parent]
        else:
            node = len(self._token)
            self._token.append(token)
            self._count.append(0)
            self._total.append(0)
            self._first.append(-1)
            self._next.append(self._first[parent])
        self._first[parent] = node
        self._edges[parent * _KEY + token] = node
        return node

    def _unmake(self, parent: int, node: int) -> None:
        if self._first[parent] == node:
            self._first[parent] = self._next[node]
        else:
            sibling = self._first[parent]
            while self._next[sibling] != node:
                sibling = self._next[sibling]
            self._next[sibling] = self._next[node]
        del self._edges[parent * _KEY + self._token[node]]
        self._free.append(node)


@dataclass
class _Track:
    """What the proposer keeps of one request."""

    trie: SuffixTrie  # its prompt and output
    seen: int = 0  # tokens of prompt + output in `trie`
    suffixes: list[int] = field(default_factory=list)  # `trie`'s nodes of its last suffixes, shortest first
    tail: list[int] = field(default_factory=list)  # its last depth - 1 tokens
    cached: list[tuple[int, int]] = field(default_factory=list)  # (length, node) of its suffixes in the cache
    version: int = -1  # the cross-request trie's version `cached` was found in


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.tracks: dict[str, _Track] = {}  # per request drafted for, until it ends
        self.cache = SuffixTrie(self.depth)  # the outputs of `cached_outputs`
        self.cached_outputs: deque[list[int]] = deque()  # least recently finished first
        self._version = 0  # bumped whenever `cache` changes: the tracks' cached nodes are found again

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int) -> list[int]:
        track = self.tracks.get(request_id)
        if track is None:
            track = self.tracks[request_id] = _Track(SuffixTrie(self.depth))
        self._catch_up(track, unseen(prompt, output, track.seen))
        if max_tokens < 1:
            return []
        own = [(length, node) for length, node in enumerate(track.suffixes, 1)][::-1]
        draft, score = self._draft(track.trie, own, max_tokens)
        other, other_score = self._draft(self.cache, track.cached, max_tokens)
        return other if other_score > score else draft

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        """Its trie goes; an output of two tokens or more enters the cross-request trie, the least recently
        finished one leaving it when that holds more than suffix_decoding_max_cached_requests."""
        self.tracks.pop(request_id, None)
        if self.max_cached == 0 or len(output) < 2:
            return
        self.cached_outputs.append(list(output))
        self.cache.insert(output)
        if len(self.cached_outputs) > self.max_cached:
            self.cache.remove(self.cached_outputs.popleft())
        self._version += 1

    def _catch_up(self, track: _Track, tokens: Sequence[int]) -> None:
        """Grow the request's trie by its new tokens, and follow its suffixes in the cross-request trie."""
        keep = self.depth - 1
        for token in tokens:
            track.suffixes = track.trie.extend(track.suffixes, token)
        track.seen += len(tokens)
        track.tail = [*track.tail, *tokens][-keep:]
        if not self.cached_outputs:
            track.cached = []
        elif track.version != self._version or len(tokens) >= keep:
            # Found anew: every suffix of the tail, longest first.
            found = ((len(track.tail) - s, self.cache.find(track.tail[s:])) for s in range(len(track.tail)))
            track.cached = [(length, node) for length, node in found if node is not None]
        else:
            for token in tokens:
                grown = [(length + 1, self.cache.child(node, token)) for length, node in track.cached]
                track.cached = [(n, c) for n, c in grown if c is not None and n <= keep]
                if (first := self.cache.child(_ROOT, token)) is not None:
                    track.cached.append((1, first))
        track.version = self._version

    def _draft(self, trie: SuffixTrie, matches: list[tuple[int, int]], room: int) -> tuple[list[int], float]:
        """From the longest of `matches` ((length, node), longest first) that some occurrence continues."""
        for length, node in matches:
            if trie.continued(node):
                return trie.follow(node, min(room, int(self.spec_factor * length)), self.min_prob)
        return [], 0.0
