"""Where a model's per-block weights live: all in memory, or streamed from the checkpoint.

:class:`BlockStore` is the ``blocks`` sequence of a :class:`~syncdrop.parallel.executor.TPModel`.
With ``resident=None`` every block is built when the model is (the default: what small models and
serving want). With ``resident=k`` a block is built from the checkpoint the first time it is asked
for and at most ``k`` are held; asking for another drops the least recently used one, which is
read again when next needed. Code that visits the blocks in order, all inputs through block ``i``
before block ``i + 1`` (layer-wise perplexity, B2B distillation), then holds about one block's
weights whatever the depth of the model, and reads each block once.

A block can also be *set* (``store[i] = weights``: a distilled block swapped in by the profiler);
it shadows the checkpoint's block, and is held whatever ``resident`` says, until ``del store[i]``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from syncdrop.parallel.weights import BlockWeights


class BlockStore:
    """The blocks ``0..n-1``, each built by ``build(i)`` (see the module docstring)."""

    def __init__(self, build: Callable[[int], BlockWeights], n: int, resident: int | None = None,
                 progress: bool = False) -> None:
        if resident is not None and resident < 1:
            raise ValueError(f"resident must be at least 1 block, got {resident}")
        self._build, self._n, self.resident = build, n, resident
        self._held: OrderedDict[int, BlockWeights] = OrderedDict()  # least recently used first
        self._set: dict[int, BlockWeights] = {}
        self.loads = 0  # blocks built from the checkpoint so far
        if resident is None:
            layers = range(n)
            if progress:
                from syncdrop.progress import progress_bar

                layers = progress_bar(layers, desc="sharding blocks", unit="block", leave=False)
            for i in layers:
                self._held[i] = self._load(i)

    @property
    def streams(self) -> bool:
        """True when blocks are read from the checkpoint on demand (``resident`` is set)."""
        return self.resident is not None

    def _load(self, i: int) -> BlockWeights:
        self.loads += 1
        return self._build(i)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> BlockWeights:
        if not -self._n <= i < self._n:
            raise IndexError(f"block {i} of {self._n}")
        i %= self._n
        if i in self._set:
            return self._set[i]
        if i in self._held:
            self._held.move_to_end(i)
            return self._held[i]
        if self.resident is not None:
            while len(self._held) >= self.resident:
                self._held.popitem(last=False)  # drop the least recently used block before reading the next
        w = self._held[i] = self._load(i)
        return w

    def __setitem__(self, i: int, w: BlockWeights) -> None:
        self._set[i % self._n] = w  # shadows the checkpoint's block until deleted

    def __delitem__(self, i: int) -> None:
        """Forget a set block: the checkpoint's block is what ``store[i]`` gives again."""
        self._set.pop(i % self._n, None)

    def __iter__(self) -> Iterator[BlockWeights]:
        return (self[i] for i in range(self._n))

    def held(self) -> list[BlockWeights]:
        """The blocks in memory now (what :meth:`TPModel.weight_bytes` counts)."""
        return [*self._held.values(), *self._set.values()]
