"""How a rank sums its micro-batches' gradients under `reproducible=True`: in the binary tree
over the micro-batch index (`TreeAccumulator`), not in arrival order.

Autograd adds each backward's gradient to the last (((g0 + g1) + g2) + g3): a chain whose
shape follows how many micro-batches a rank runs, so dp 1 (one chain of 8) and dp 2 (two
chains of 4, then a sum across ranks) round differently. Here every backward's gradient is
a leaf, taken out of `.grad` by the gradient hook, and leaves are combined as a binary
counter combines bits: ((g0 + g1) + (g2 + g3)). With k micro-batches per rank, k a power of
two, rank r's sum is the subtree of the global micro-batches [r·k, (r+1)·k), and the ordered
reduction's tree across ranks (`reduction.tree_sum_`) completes the same tree at every
data-parallel size.

A micro-batch in which a parameter got no gradient is an empty leaf, the identity of the
sum. Leaves are summed in the reduction's dtype (`dtype`: fp32 for bf16 parameters), and
the stack holds at most log2(k) partial sums per parameter beside autograd's gradient.
"""

from __future__ import annotations

from torch import Tensor


def _combine(left: Tensor | None, right: Tensor | None) -> Tensor | None:
    if left is None:
        return right
    if right is not None:
        left.add_(right)
    return left


class TreeAccumulator:
    """Per parameter, the stack of partial sums of a binary counter over this step's
    micro-batches (`push` one leaf per backward), collapsed into the rank's sum (`collapse`)."""

    def __init__(self) -> None:
        # id(param) → [(first micro-batch, count, partial sum or None for empty leaves)]
        self.stacks: dict[int, list[tuple[int, int, Tensor | None]]] = {}

    def push(self, key: int, index: int, leaf: Tensor | None) -> None:
        """Add micro-batch `index`'s gradient `leaf` (a tensor the accumulator may keep and
        add into) of parameter `key`; earlier micro-batches it missed are empty leaves."""
        stack = self.stacks.setdefault(key, [])
        nxt = stack[-1][0] + stack[-1][1] if stack else 0
        if index < nxt:
            raise RuntimeError(f"micro-batch {index} of a parameter arrived twice")
        self._fill(stack, index)
        self._put(stack, index, leaf)

    @staticmethod
    def _put(stack: list[tuple[int, int, Tensor | None]], index: int, leaf: Tensor | None) -> None:
        first, count, value = index, 1, leaf
        while stack and stack[-1][1] == count:
            lo, _, left = stack.pop()
            first, count, value = lo, 2 * count, _combine(left, value)
        stack.append((first, count, value))

    def _fill(self, stack: list[tuple[int, int, Tensor | None]], upto: int) -> None:
        """Empty leaves for the micro-batches before `upto` that the stack has not seen."""
        nxt = stack[-1][0] + stack[-1][1] if stack else 0
        for i in range(nxt, upto):
            self._put(stack, i, None)

    def pending(self, key: int) -> bool:
        return key in self.stacks

    def collapse(self, key: int, count: int) -> Tensor | None:
        """Parameter `key`'s sum over this step's `count` micro-batches (None when it had no
        gradient in any). A `count` that is not a power of two leaves several subtrees,
        summed from the right (the driver refuses such a step)."""
        stack = self.stacks.pop(key, [])
        self._fill(stack, count)
        value: Tensor | None = None
        for _, _, part in reversed(stack):
            value = _combine(part, value)
        return value

    def reset(self) -> None:
        self.stacks.clear()
