"""Preallocated key/value cache of one stage, with the three edits speculation needs.

Layout: `committed` entries at slots [0, length) are final; the previous step's entries sit at
[length, length + pending) until the next step says which of them to keep. Keeping compacts the
chosen entries into place, so accepting speculative tokens costs no recomputation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_context: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, 1, num_kv_heads, max_context, head_dim)
        # Uninitialized: attention reads only the slots [0, length + pending) a step has written, and the
        # pages of slots never written are never touched, so a long max_context costs memory as it fills.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(max_context, dtype=torch.long)
        self.max_context = max_context
        self.length = 0
        self.pending = 0

    @property
    def nbytes(self) -> int:
        """Bytes reserved for the whole max_context (resident as the slots fill)."""
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def position_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one position takes in a cache of these dimensions."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def check_keep(self, keep: Sequence[int]) -> None:
        """Raise ValueError unless `keep` is a strictly increasing list of pending entries."""
        prev = -1
        for i in keep:
            if not isinstance(i, int) or isinstance(i, bool) or i <= prev or i >= self.pending:
                raise ValueError(
                    f"keep must be strictly increasing indices into the previous step's {self.pending} entries"
                )
            prev = i

    def keep(self, keep: Sequence[int]) -> None:
        """Commit the chosen entries of the previous step, in order, and drop the rest."""
        self.check_keep(keep)
        n = len(keep)
        if n and list(keep) != list(range(n)):
            src = torch.tensor(keep, dtype=torch.long) + self.length
            dst = slice(self.length, self.length + n)
            for buf in (self.k, self.v):
                buf[:, :, :, dst] = buf.index_select(3, src.to(buf.device))
            self.positions[dst] = self.positions[src]
        self.length += n
        self.pending = 0

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_context:
            raise ValueError(
                f"step of {n} positions over a committed context of {self.length} exceeds the "
                f"maximum context of {self.max_context}"
            )

    def stage_new(self, positions: torch.Tensor) -> None:
        """Record the positions of the entries this step appends (their K/V are written per layer)."""
        n = positions.numel()
        self.check_room(n)
        self.positions[self.length : self.length + n] = positions
        self.pending = n

    def checkpoint(self, keep: Sequence[int], crop: int | None = None) -> Callable[[], None]:
        """Before a step that crops to `crop` (None: no crop) and applies `keep`: a function restoring
        the cache to exactly this state.

        A step can only overwrite the previous step's entries from the first one `keep` moves (a kept
        prefix stays in place), so only those slots are copied: a sequential decode step copies nothing.
        A crop frees every slot from `crop` on, so those are copied.
        """
        length, pending = self.length, self.pending
        first = next((j for j, i in enumerate(keep) if i != j), len(keep))
        start = length + min(first, pending) if crop is None else crop
        region = slice(start, length + pending)
        saved = (self.k[:, :, :, region].clone(), self.v[:, :, :, region].clone(), self.positions[region].clone())

        def restore() -> None:
            self.k[:, :, :, region], self.v[:, :, :, region], self.positions[region] = saved
            self.length, self.pending = length, pending

        return restore

    def reopen(self, n: int) -> None:
        """Make the last `n` committed entries pending again, before the pending ones.

        A step run as several forwards commits each part before the next; reopening its earlier
        parts afterwards leaves the cache as one forward of the whole step would have.
        """
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot reopen {n} of {self.length} committed entries")
        self.length -= n
        self.pending += n

    def check_crop(self, length: int) -> None:
        """Raise ValueError unless the cache can be cut back to `length` committed entries."""
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} committed entries to {length}")

    def crop(self, length: int) -> None:
        """Forget everything from `length` on (committed or pending)."""
        self.check_crop(length)
        self.length = length
        self.pending = 0

    def layer(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Views of layer i's cache covering the committed entries plus this step's n, and the write offset."""
        end = self.length + n
        return self.k[i, :, :, :end], self.v[i, :, :, :end], self.length
