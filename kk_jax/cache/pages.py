"""Host-side allocators for KV pages and per-sequence state slots.

Index 0 of each is reserved: padded batch rows point at page 0 / slot 0, so a padded row
can never alias a live sequence (DESIGN rule 5). Freed slots are handed out again only
after the caller zeroes them (``take_dirty``).
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Not enough free pages or slots for the allocation."""


class PageAllocator:
    """Free list of page ids 1..num_pages-1 (page 0 is the dummy)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))   # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages a sequence can ever use (all but the dummy)."""
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated")
            self._used.remove(p)
            self._free.append(p)


class SlotAllocator:
    """Per-sequence state slots 1..num_slots-1 (slot 0 is the dummy).

    A slot returned by :meth:`allocate` is recorded as dirty until the caller zeroes it on
    the device and calls :meth:`take_dirty`.
    """

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"need at least 2 slots (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))
        self._used: set[int] = set()
        self._dirty: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfPages("no free state slot")
        slot = self._free.pop()
        self._used.add(slot)
        self._dirty.append(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        if slot in self._dirty:
            self._dirty.remove(slot)
        self._free.append(slot)

    def take_dirty(self) -> list[int]:
        """Slots allocated since the last call; the caller must zero them before use."""
        dirty, self._dirty = self._dirty, []
        return dirty
