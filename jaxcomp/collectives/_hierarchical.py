"""The hierarchical algorithm over ``(slow, fast)`` axes: full precision on
the fast axis, compression only on the slow one."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Rate
from jaxcomp.collectives import _algorithm
from jaxcomp.collectives._algorithm import (
    Algorithm,
    Collective,
    register,
    uncompressed_send_nbytes,
)
from jaxcomp.collectives._chunks import chunked
from jaxcomp.collectives._order import after


@register
@dataclasses.dataclass(frozen=True)
class Hierarchical(Algorithm):
    """Full precision over the fast axis, compression only over the slow one:
    reduce-scatter over ``fast`` (``psum_scatter``), a compressed all-reduce
    of this device's chunk over ``slow`` (by the ``auto`` rule, with the
    server residual of that all-reduce), then an all-gather over ``fast``.
    The slow stage's first compression is of a chunk summed over the node,
    and its error is charged to the device that owns the chunk within its
    node: its residual re-enters exactly that sum at the next step."""

    name: ClassVar[str] = "hierarchical"
    num_axes: ClassVar[int] = 2
    auto_rank: ClassVar[int | None] = 0
    planned_rates: ClassVar[frozenset[Rate]] = frozenset(Rate)

    def run(self, ctx, flat, state):
        slow, fast = ctx.axes.slow, ctx.axes.fast
        chunks, _ = chunked(flat.astype(jnp.float32), fast.size)
        mine = lax.psum_scatter(chunks, fast.name, scatter_dimension=0, tiled=True)[0]
        reduced, sent_mine, state = _algorithm.all_reduce(
            ctx.over(slow), mine.astype(flat.dtype), "auto", state
        )
        total = lax.all_gather(reduced, fast.name, tiled=True)[: flat.size]
        error = jnp.zeros_like(chunks).at[lax.axis_index(fast.name)].set(sent_mine - mine)
        return total, (chunks + error).reshape(-1)[: flat.size], state

    def run_feedback(self, ctx, flat, residual, state):
        """Error feedback (a float32 tensor): ``acc = flat + residual`` is
        reduce-scattered in full precision, so only the slow stage loses
        anything, and what it misses of my node-summed chunk is my new
        residual there (zero elsewhere): the slow all-reduce's own error
        feedback (``run_feedback``, with a zero residual: one pass where
        the codec has the kernel), with no ``sent`` tensor formed and
        subtracted. Other dtypes: the separate steps."""
        if flat.dtype != jnp.float32:
            return super().run_feedback(ctx, flat, residual, state)
        slow, fast = ctx.axes.slow, ctx.axes.fast
        acc = after(flat, ctx.dep) + residual
        chunks, _ = chunked(acc, fast.size)
        mine = lax.psum_scatter(chunks, fast.name, scatter_dimension=0, tiled=True)[0]
        reduced, kept_mine, state = _algorithm.all_reduce_feedback(
            ctx.over(slow), mine, jnp.zeros_like(mine), "auto", state
        )
        total = lax.all_gather(reduced, fast.name, tiled=True)[: flat.size]
        kept = jnp.zeros_like(chunks).at[lax.axis_index(fast.name)].set(kept_mine)
        return total, kept.reshape(-1)[: flat.size], state

    def chosen(self, codec, n, axes):
        """The one algorithm of two axes."""
        return True

    def state_size(self, codec, n, dtype, axes):
        """That of the slow-axis all-reduce of a ``ceil(n / fast)`` chunk
        (by the ``auto`` rule)."""
        return _algorithm.state_size(codec, _chunk(n, axes), dtype, axes.slow)

    def state_positions(self, codec, n, dtype, axes, m):
        """The slow-axis positions of every device's chunk, device by device
        in mesh order (slow-major)."""
        slow, fast = axes.sizes
        cf = _chunk(n, axes)
        inner = _algorithm.state_positions(codec, cf, dtype, axes.slow)  # [slow, m]
        rows = []
        for i in range(slow):
            for j in range(fast):
                pos = np.where(inner[i] >= 0, inner[i] + j * cf, -1)
                rows.append(np.where(pos < n, pos, -1))
        return np.asarray(rows, np.int64).reshape(slow * fast, -1)

    def operand_nbytes(self, codec, n, dtype, axes):
        raise ValueError(
            "operand_nbytes: the hierarchical algorithm has two axes; not supported here"
        )

    def send_nbytes(self, codec, n, dtype, axes):
        """float32 over the fast axis (a ring all-reduce's bytes), the
        compressed all-reduce of a chunk over the slow one."""
        chunk = -(-n // axes.fast.size)
        return uncompressed_send_nbytes(4 * n, axes.fast.size) + _algorithm.send_nbytes(
            codec, chunk, dtype, axes.slow
        )

    def collectives(self, codec, n, dtype, axes, bits=None):
        """The float32 reduce-scatter and all-gather over the fast axis
        (axis 1) around the slow stage's collectives (axis 0), the
        algorithm ``auto`` picks for a ``ceil(n / fast)`` chunk."""
        m = _chunk(n, axes)
        slow = _algorithm.collectives(codec, m, dtype, axes.slow, "auto", bits)
        return [
            Collective("reduce-scatter", 4 * axes.fast.size * m, axis=1),
            *slow,
            Collective("all-gather", 4 * m, axis=1),
        ]

    def kernel_calls(self, codec, n, dtype, axes):
        """The slow stage's, on one chunk."""
        return _algorithm.kernel_calls(codec, _chunk(n, axes), dtype, axes.slow, "auto")

    def compressed_values(self, n, axes):
        """The node-summed chunk of the slow stage."""
        return _chunk(n, axes)

    def label(self, codec, n, axes):
        """With the slow stage's algorithm: "hierarchical(two_phase)"."""
        return f"{self.name}({self.compressor(codec, n, axes).name})"

    def compressor(self, codec, n, axes):
        """The slow stage's algorithm, which compresses the node-summed
        chunks (the fast stage is float32)."""
        return _algorithm.choose(codec, _chunk(n, axes), axes.slow)


def _chunk(n: int, axes) -> int:
    """The chunk of ``n`` values one device of the fast axis reduces over
    the slow one."""
    return -(-n // axes.fast.size) if n else 0
