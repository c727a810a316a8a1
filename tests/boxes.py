"""Random boxes (per-dimension [lo, hi) ranges) of a tensor shape, for reader tests."""

from __future__ import annotations

import random


def random_box(shape: list[int], rng: random.Random) -> tuple[tuple[int, int], ...]:
    """A non-empty box inside ``shape``, uniformly placed in each dimension."""
    box = []
    for n in shape:
        lo = rng.randrange(n)
        box.append((lo, rng.randrange(lo + 1, n + 1)))
    return tuple(box)
