"""Which new positions of a step see which: trees as parent indices, anything else as a bit matrix.

Every new position always sees the committed cache (subject to sliding windows); among the new
positions, a tree node sees its ancestors and itself, and a general pattern (lookahead's Jacobi
window) gives each row explicitly. The wire carries parents or packed bits, never a float mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Visibility:
    """n x n boolean matrix, row i = the new positions that position i attends to."""

    matrix: torch.Tensor
    parents: tuple[int, ...] | None = None

    @property
    def n(self) -> int:
        return self.matrix.shape[0]

    @classmethod
    def chain(cls, n: int) -> Visibility:
        return cls.from_parents(range(-1, n - 1))

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> Visibility:
        """A forest: parent -1 hangs a node directly off the committed cache."""
        parents = tuple(parents)
        n = len(parents)
        m = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(parents):
            if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or not -1 <= p < i:
                raise ValueError(f"parent of node {i} must be an earlier node or -1, got {p!r}")
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return cls(torch.from_numpy(m), parents)

    @classmethod
    def from_matrix(cls, matrix: np.ndarray | torch.Tensor) -> Visibility:
        m = torch.as_tensor(np.asarray(matrix, dtype=bool))
        if m.ndim != 2 or m.shape[0] != m.shape[1]:
            raise ValueError("visibility matrix must be square")
        if not bool(m.diagonal().all()):
            raise ValueError("every position must see itself")
        return cls(m)

    def to_wire(self) -> tuple[tuple[int, ...] | None, bytes | None]:
        """(parents, None) for a forest, else (None, the matrix's packed bits): a step message's fields."""
        if self.parents is not None:
            return self.parents, None
        return None, np.packbits(self.matrix.numpy(), axis=None).tobytes()

    @classmethod
    def from_wire(cls, parents: Sequence[int] | None, bits: bytes | None, n: int) -> Visibility:
        """The visibility of n entries from a step message's fields; neither: a chain."""
        if parents is not None:
            if len(parents) != n:
                raise ValueError(f"parents must be a list of {n} indices")
            return cls.from_parents(parents)
        if bits is None:
            return cls.chain(n)
        if not isinstance(bits, bytes) or len(bits) != (n * n + 7) // 8:
            raise ValueError(f"visibility bits must be {(n * n + 7) // 8} bytes for {n} positions")
        flat = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=n * n)
        return cls.from_matrix(flat.reshape(n, n))

    def cuts(self, limit: int) -> list[tuple[int, int]]:
        """[start, end) parts of at most `limit` positions, cut only where the result stays exact.

        A cut at s is exact when every position from s on sees every position before s: then the
        positions before s can be committed to the cache first, which every later position sees. A
        part that cannot be cut (a tree wider than `limit`) stays whole.
        """
        n = self.n
        if n <= limit:
            return [(0, n)]
        cols = torch.arange(n)
        unseen = ~self.matrix & (cols[None, :] < cols[:, None])
        first_unseen = torch.where(unseen, cols[None, :], cols[:, None]).min(dim=1).values  # per row, <= row
        from_here = torch.flip(torch.cummin(torch.flip(first_unseen, [0]), 0).values, [0])
        cuttable = (from_here >= cols).tolist()  # cut at s: every row >= s sees all of [0, s)
        parts, start = [], 0
        while n - start > limit:
            end = next((s for s in range(start + limit, start, -1) if cuttable[s]), None)
            if end is None:
                break
            parts.append((start, end))
            start = end
        return [*parts, (start, n)]

    def part(self, start: int, end: int) -> Visibility:
        """The visibility among positions [start, end) once the earlier ones are in the cache."""
        if (start, end) == (0, self.n):
            return self
        if self.parents is not None:
            return Visibility.from_parents([p - start if p >= start else -1 for p in self.parents[start:end]])
        return Visibility.from_matrix(self.matrix[start:end, start:end])

    def additive_mask(
        self, cache_positions: torch.Tensor, positions: torch.Tensor, window: int | None, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """(1, 1, n, L + n) additive mask, or None when every pair is visible (the fast path)."""
        n = self.n
        see_cache = torch.ones(n, cache_positions.numel(), dtype=torch.bool)
        see_new = self.matrix
        if window is not None:
            see_cache = see_cache & (positions[:, None] - cache_positions[None, :] < window)
            see_new = see_new & (positions[:, None] - positions[None, :] < window)
        visible = torch.cat([see_cache, see_new], dim=1)
        if bool(visible.all()):
            return None
        mask = torch.zeros(visible.shape, dtype=dtype)
        mask.masked_fill_(~visible, float("-inf"))
        return mask[None, None]
