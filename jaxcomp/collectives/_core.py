"""Compressed psum/pmean: the allgather, two-phase and ring algorithms."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Codec, Rate, as_codec
from jaxcomp.collectives import _sparse, _util
from jaxcomp.collectives._util import (
    after,
    axis_size,
    chunk_len,
    chunked,
    decode_f32,
    decode_own,
    decode_rows,
    decode_sum,
    device_key,
    exchange,
    fold,
    fused_backend,
    own_capacity,
    owner_stage,
    padded,
    split,
    transfer,
)

ALGORITHMS = ("auto", "allgather", "two_phase", "ring", "sparse", "allreduce", "hierarchical")


class Reduced(NamedTuple):
    """Result of a compressed all-reduce.

    Attributes:
      value: the sum (or mean) over the axis, in the input's shape and dtype,
        identical on every device.
      sent: float32, the input's shape: what this device's input became
        after its own compression. Without a ``state``, every stage's error
        is charged here (one-level error feedback), and summed over the
        devices ``sent`` equals ``value`` (times the axis size, for
        ``pmean``) up to float rounding. With a ``state``, the errors of the
        later stages stay in the state instead, and summed over the devices
        ``sent + div * (state_in - state_out)`` (the states' parts at the
        positions they hold, see :func:`state_size`) equals ``div * value``,
        ``div`` being 1 for ``psum`` and the axis size for ``pmean``.
      state: the new server residual (float32, per device) when one was
        passed, else None.
    """

    value: jax.Array
    sent: jax.Array
    state: jax.Array | None = None


# ---------------------------------------------------------------------------
# Algorithms. Each takes the flat input and the server residual (or None)
# and returns (sum / div float32, sent float32, new server residual or None).
# ---------------------------------------------------------------------------
def _allgather(codec, flat, axis_name, size, key, div, state):
    p = codec.encode(flat, key)
    gather = lambda a: lax.all_gather(a, axis_name)  # noqa: E731
    total = transfer(p, axis_name, "all-gather", gather, decode_sum)
    return (total if div == 1 else total / div), decode_own(p), state


def _allreduce(codec, flat, axis_name, size, key, div, state):
    """Linear codecs: the payloads themselves are summed by one ``psum``
    (every device encodes with the same key), then decoded once."""
    if codec.rate is not Rate.LINEAR:
        raise ValueError(
            f"jc.psum: algorithm='allreduce' sums payloads, which only linear codecs "
            f"(codec.rate is Rate.LINEAR) allow; {codec!r} is {codec.rate.value}-rate"
        )
    p = codec.encode(flat, key)
    arrays = p.arrays
    _util.record("all-reduce", arrays.values())
    summed = p.map(lambda a: lax.psum(a, axis_name))
    total = decode_f32(summed)
    return (total if div == 1 else total / div), decode_own(p), state


def _two_phase(codec, flat, axis_name, size, key, div, state):
    """Reduce-scatter of compressed chunks (all_to_all), then an allgather of
    the re-compressed reduced chunks: DeepSpeed's compressed allreduce, and
    the reduce-and-broadcast of the low-precision study (section 2.4.1).
    The server residual is the owned chunk's (``chunk_len`` values).
    Large tensors go through :func:`_two_phase_pipelined`."""
    depth = pipeline_depth(codec, flat.size, size)
    if depth > 1:
        return _two_phase_pipelined(codec, flat, axis_name, size, key, div, state, depth)
    me = lax.axis_index(axis_name)
    n, dtype = flat.size, flat.dtype
    backend = fused_backend(codec)
    if codec.split_granularity():
        # One encoding of the whole tensor, cut into per-owner payloads.
        c = chunk_len(codec, n, size)
        p = codec.encode(padded(flat, size * c), key)
        payloads = split(p, size)
        stage1 = decode_own(p)  # my chunks as their owners see them
    else:
        chunks, c = chunked(flat, size)
        keys = (
            None
            if key is None
            else jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(size))
        )
        payloads = jax.vmap(codec.encode)(chunks, keys)
        stage1 = decode_rows(payloads, backend).reshape(-1)
    to_owner = lambda a: lax.all_to_all(a, axis_name, 0, 0)  # noqa: E731
    # My chunk, summed over the devices.
    mine = transfer(payloads, axis_name, "all-to-all", to_owner, decode_sum)
    p2, _, new_state, error = owner_stage(codec, mine, div, state, fold(key, size), dtype)
    gather = lambda a: lax.all_gather(a, axis_name)  # noqa: E731
    total = transfer(
        p2, axis_name, "all-gather", gather, lambda q: decode_rows(q, backend).reshape(-1)[:n]
    )
    if error is None:
        return total, stage1[:n], new_state
    # One-level error feedback: the second stage's error on my chunk (in
    # units of the sum) is mine to carry.
    start = me * c
    sent = lax.dynamic_update_slice(
        stage1, lax.dynamic_slice(stage1, (start,), (c,)) + error, (start,)
    )
    return total, sent[:n], None


# Two-phase may cut a tensor into up to this many segments, each a two-phase
# all-reduce of its own, so that one segment's decoding and second
# compression run while another's payloads are on the wire (see
# pipeline_depth). 1, the default, turns the pipeline off: on the CPU test
# bed it saved nothing (the figures: docs/collectives.md, "Overlap: the
# pipelined two-phase all-reduce"), and no GPU has measured it.
PIPELINE_MAX_DEPTH = 1
# ... and only where every owner's part of a segment keeps this many values
# (below it a collective's fixed cost outweighs what the overlap saves).
PIPELINE_MIN_VALUES = 1 << 18


def pipeline_depth(codec: Codec, n: int, size: int) -> int:
    """How many segments the two-phase all-reduce of ``n`` values over
    ``size`` devices is pipelined in (1: not pipelined).

    Only fixed-rate codecs that split at a granularity (one encoding of a
    tensor cut into per-chunk payloads; variable-rate payloads travel in
    capacity tiers chosen per call) are pipelined, in the deepest of
    :data:`PIPELINE_MAX_DEPTH`, ..., 2 segments that divides every owner's
    chunk into whole granules of at least :data:`PIPELINE_MIN_VALUES`
    values. The chunks, and so the server residual's layout, are those of
    the unpipelined algorithm.
    """
    g = codec.split_granularity()
    if not g or codec.rate is Rate.VARIABLE or size < 2:
        return 1
    c = chunk_len(codec, n, size)
    for depth in range(PIPELINE_MAX_DEPTH, 1, -1):
        if c % (depth * g) == 0 and c // depth >= PIPELINE_MIN_VALUES:
            return depth
    return 1


def _two_phase_pipelined(codec, flat, axis_name, size, key, div, state, depth):
    """Two-phase in ``depth`` segments. The tensor is encoded once and its
    payload cut per owner, as in :func:`_two_phase`; each owner's chunk is
    then viewed as ``depth`` parts, and segment ``s`` (the ``s``-th part of
    every owner's chunk) goes through its own all-to-all, decode-and-sum,
    second compression and all-gather.

    XLA runs a program's operations as their inputs become ready (on the
    CPU, the thunk executor hands independent ones to its thread pool; on
    GPUs, collectives run on their own stream), so one segment's decoding
    and second compression overlap the next one's transfer. The collectives
    go in one fixed order on every device (all-to-all 0, all-to-all 1,
    all-gather 0, all-to-all 2, ...), each one's operand tied to the
    previous one's result (:func:`after`).

    The first compression, ``sent`` and the server residual's layout are
    the unpipelined algorithm's. For deterministic codecs the result and the
    new state are too, bit for bit (the codec splits at the part
    boundaries), and so is ``sent`` but on the owner's chunk under one-level
    error feedback, where XLA may fuse the added error differently (the last
    bit); stochastic codecs draw the second compression's bits from one key
    per segment: other bits, of the same distribution.
    """
    me = lax.axis_index(axis_name)
    n, dtype = flat.size, flat.dtype
    backend = fused_backend(codec)
    c = chunk_len(codec, n, size)
    part = c // depth
    p = codec.encode(padded(flat, size * c), key)
    sent = decode_own(p)  # my chunks as their owners see them
    # [size * depth] payloads of ``part`` values, owner-major.
    pieces = split(p, size * depth)
    states = None if state is None else state.reshape(depth, part)
    to_owner = lambda a: lax.all_to_all(a, axis_name, 0, 0)  # noqa: E731
    gather = lambda a: lax.all_gather(a, axis_name)  # noqa: E731
    totals, new_states, errors = [], [], []
    last = None  # the result of the latest collective, to order the next one

    def send(payload, op, kind):
        nonlocal last
        got = exchange(op, after(payload, last), kind)
        last = got.arrays
        return got

    def finish(p2):
        got = send(p2, gather, "all-gather")
        totals.append(decode_rows(got, backend))  # [size, part]

    pending = None  # the previous segment's reduced part, compressed again
    for s in range(depth):
        segment = pieces.map(lambda a, s=s: a.reshape(size, depth, *a.shape[1:])[:, s])
        received = send(segment, to_owner, "all-to-all")
        if pending is not None:
            finish(pending)
        p2, _, new_state, error = owner_stage(
            codec,
            decode_sum(received),
            div,
            None if states is None else states[s],
            fold(fold(key, size), s),
            dtype,
        )
        new_states.append(new_state)
        errors.append(error)
        pending = p2
    finish(pending)
    total = jnp.stack(totals, axis=1).reshape(-1)[:n]
    if state is not None:
        return total, sent[:n], jnp.concatenate(new_states)
    # One-level error feedback: the second stage's error on my chunk.
    start = me * c
    mine = lax.dynamic_slice(sent, (start,), (c,)) + jnp.concatenate(errors)
    return total, lax.dynamic_update_slice(sent, mine, (start,))[:n], None


def _ring(codec, flat, axis_name, size, key, div, state):
    """The ring all-reduce of Gibiansky's "Bringing HPC techniques to deep
    learning": P-1 scatter-reduce steps, then P-1 allgather steps, with
    ppermute to the next device; each hop's chunk is compressed. In the
    allgather each reduced chunk is compressed once by its owner and
    forwarded as is.

    Each scatter-reduce step compresses a running partial sum, of a
    different chunk at every step (at step s, device d sends chunk d - s).
    With a server residual (``P`` rows of ``ceil(n / P)``, in units of the
    result) each of those compressions has a residual of its own, row s for
    step s and row P - 1 for the owner's last compression, so no error ever
    lands in a tensor of another scale; the input is divided by ``div``
    first, so every row is in the result's units, and ``sent`` is the input
    itself. Without one, every step's error is charged to the sender's
    ``sent`` (one-level error feedback)."""
    me = lax.axis_index(axis_name)
    dtype = flat.dtype
    chunks, c = chunked(flat, size)
    acc = chunks.astype(jnp.float32)
    if state is not None:
        rows = state.reshape(size, c)
        new_rows = []
        if div != 1:
            acc = acc / div
    sent = chunks.astype(jnp.float32)
    perm = [(d, (d + 1) % size) for d in range(size)]
    to_next = lambda a: lax.ppermute(a, axis_name, perm)  # noqa: E731

    def hop(p):
        """One ppermute hop: (the received chunk decoded, its payload at
        the codec's own capacity, ready to forward)."""
        return transfer(
            p,
            axis_name,
            "collective-permute",
            to_next,
            lambda q: (decode_f32(q, fused_backend(codec)), own_capacity(codec, q)),
        )

    for s in range(size - 1):
        j = (me - s) % size  # chunk I send
        partial = lax.dynamic_index_in_dim(acc, j, keepdims=False)
        if state is not None:
            partial = partial + rows[s]
        p = codec.encode(partial.astype(dtype), fold(key, s))
        hat = decode_own(p)
        if state is not None:
            new_rows.append(partial - hat)
        else:
            sent = lax.dynamic_update_index_in_dim(
                sent, lax.dynamic_index_in_dim(sent, j, keepdims=False) + (hat - partial), j, 0
            )
        got, _ = hop(p)
        r = (me - 1 - s) % size  # chunk I receive
        acc = lax.dynamic_update_index_in_dim(
            acc, lax.dynamic_index_in_dim(acc, r, keepdims=False) + got, r, 0
        )
    own = (me + 1) % size
    reduced = lax.dynamic_index_in_dim(acc, own, keepdims=False)
    if state is not None:
        p, hat, last, _ = owner_stage(codec, reduced, 1, rows[size - 1], fold(key, size), dtype)
        new_state = jnp.stack([*new_rows, last]).reshape(-1)
    else:
        p, hat, new_state, error = owner_stage(codec, reduced, div, None, fold(key, size), dtype)
        sent = lax.dynamic_update_index_in_dim(
            sent, lax.dynamic_index_in_dim(sent, own, keepdims=False) + error, own, 0
        )
    out = lax.dynamic_update_index_in_dim(jnp.zeros_like(acc), hat, own, 0)
    for s in range(size - 1):
        got, p = hop(p)
        r = (me - s) % size  # the owner of this payload is me - 1 - s; it owns chunk me - s
        out = lax.dynamic_update_index_in_dim(out, got, r, 0)
    return out.reshape(-1)[: flat.size], sent.reshape(-1)[: flat.size], new_state


_IMPLS = {
    "allgather": _allgather,
    "allreduce": _allreduce,
    "two_phase": _two_phase,
    "ring": _ring,
    "sparse": _sparse.sparse,
}


def _resolve(codec: Codec, n: int, size: int, algorithm: str) -> str:
    return choose_algorithm(codec, n, size) if algorithm == "auto" else algorithm


def _reduce(codec, flat, axis_name, algorithm, key, div=1, state=None):
    """(sum / div float32, sent float32, new state) of ``flat`` over one
    axis; ``algorithm`` may be "auto". One device: encode and decode locally.

    ``div`` (pmean) is applied before the last compression, where the
    algorithm has one, so the mean costs no extra pass; ``sent`` stays in
    units of the sum."""
    size = axis_size(axis_name)
    if size == 1:
        if div == 1:
            sent = decode_f32(codec.encode(flat, key))
            return sent, sent, state
        hat = decode_f32(codec.encode((flat.astype(jnp.float32) / div).astype(flat.dtype), key))
        return hat, hat * div, state
    algorithm = _resolve(codec, flat.size, size, algorithm)
    return _IMPLS[algorithm](codec, flat, axis_name, size, key, div, state)


def _hierarchical(codec, flat, slow, fast, key, div=1, state=None):
    """Full precision over the fast axis, compression only over the slow one:
    reduce-scatter over ``fast`` (``psum_scatter``), a compressed all-reduce
    of this device's chunk over ``slow`` (by the ``auto`` rule, with the
    server residual of that all-reduce), then an all-gather over ``fast``.
    The slow stage's first compression is of a chunk summed over the node,
    and its error is charged to the device that owns the chunk within its
    node: its residual re-enters exactly that sum at the next step."""
    chunks, _ = chunked(flat.astype(jnp.float32), axis_size(fast))
    mine = lax.psum_scatter(chunks, fast, scatter_dimension=0, tiled=True)[0]  # summed over fast
    reduced, sent_mine, state = _reduce(
        codec, mine.astype(flat.dtype), slow, "auto", key, div, state
    )
    total = lax.all_gather(reduced, fast, tiled=True)[: flat.size]
    error = jnp.zeros_like(chunks).at[lax.axis_index(fast)].set(sent_mine - mine)
    return total, (chunks + error).reshape(-1)[: flat.size], state


# Up to this many devices, codecs whose second compression is "coarse" go
# through allgather: (P - 1) C(n) bytes per device against about 2 C(n) for
# two-phase, at most 3.5x at 8 devices, for accuracy that two-phase loses
# (docs/accuracy.md). Beyond it allgather's bytes grow with P, and the
# two-phase all-reduce (with its server residual) is chosen.
COARSE_ALLGATHER_MAX_DEVICES = 8


def choose_algorithm(codec: Codec, n: int, axis_size: int) -> str:
    """The rule behind ``algorithm="auto"`` (one axis): what trains best at
    the fewest bytes, per codec (the table in docs/collectives.md).

    - Linear codecs (``Rate.LINEAR``, e.g. Identity): ``allreduce``, one
      ``psum`` of the payloads.
    - Sparse codecs (``Rate.SPARSE``, TopK): ``sparse``, SparCML's algorithms
      (static sparse all-reduce or DSAR_Split_allgather by the density rule
      of its section 5.1: see :func:`jaxcomp.collectives._sparse.static_fits`).
    - Two devices, or fewer values than devices: ``allgather`` (the same
      bytes as two-phase, one compression instead of two).
    - Codecs that cannot take a second compression under error feedback
      (``codec.recompression == "unsafe"``: TernGrad): ``allgather``.
    - Codecs that lose accuracy to it (``"coarse"``: OneBit, SignSGD, 3LC
      with sparsity above 1): ``allgather`` up to
      :data:`COARSE_ALLGATHER_MAX_DEVICES` devices, ``two_phase`` beyond.
    - Otherwise ``two_phase``, whose bytes per device stay near 2 (P-1)/P of
      one compressed tensor where ``allgather`` sends (P-1) of them, with
      two compressions where the ring needs P. This holds for variable-rate
      codecs (ThreeLC) too, whose payloads travel in capacity tiers.

    Args:
      codec: the codec.
      n: elements of the tensor.
      axis_size: devices on the axis.
    Returns:
      The algorithm's name.
    """
    if codec.rate is Rate.LINEAR:
        return "allreduce"
    if axis_size > 1 and n > 0 and codec.rate is Rate.SPARSE:
        return "sparse"
    if axis_size <= 2 or n < axis_size:
        return "allgather"
    if codec.recompression == "unsafe":
        return "allgather"
    if codec.recompression == "coarse" and axis_size <= COARSE_ALLGATHER_MAX_DEVICES:
        return "allgather"
    return "two_phase"


def recompression_warning(codec: Codec, algorithm: str) -> str | None:
    """Why ``codec`` should not be trained with error feedback through
    ``algorithm`` (a dense algorithm that compresses twice), or None."""
    if algorithm not in ("two_phase", "ring") or codec.recompression != "unsafe":
        return None
    return (
        f"{codec!r} with algorithm={algorithm!r} and error feedback: its rounding is not a "
        "contraction, so the residual of the second compression (of a reduced chunk) grows "
        "without bound and training diverges (docs/accuracy.md). Use algorithm='auto' "
        "(allgather for this codec) or train it without error feedback."
    )


def _check_state(state, codec, n, dtype, sizes, algorithm):
    if state is None:
        return None
    want = state_size(codec, n, dtype, sizes, algorithm)
    shape = getattr(state, "shape", None)
    if shape != (want,) or state.dtype != jnp.float32:
        got = f"{state.dtype.name}{list(shape)}" if shape is not None else type(state).__name__
        raise ValueError(
            f"jc.psum: state must be float32[{want}] for {codec!r} over {n} values with "
            f"algorithm={algorithm!r} on axes of sizes {sizes} (jc.collectives.init_state), "
            f"got {got}"
        )
    return state


def _all_reduce(x, axis_name, codec, key, algorithm, mean: bool, state) -> Reduced:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"jc.psum: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    codec = as_codec(codec, "jc.psum")  # a codec, its class or its spec string
    x = codec.check_input(x)
    flat = x.reshape(-1)
    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 2 or algorithm not in ("auto", "hierarchical"):
            raise ValueError(
                "jc.psum: a tuple of axis names means the hierarchical algorithm over "
                "(slow, fast) axes, e.g. ('node', 'local'); got "
                f"axis_name={axis_name!r}, algorithm={algorithm!r}"
            )
        slow, fast = axis_name
        sizes = tuple(axis_size(name) for name in axis_name)  # clear error for an unbound name
        state = _check_state(state, codec, flat.size, x.dtype, sizes, algorithm)
        div = int(np.prod(sizes)) if mean else 1
        key = device_key(codec, key, axis_name)
        total, sent, state = _hierarchical(codec, flat, slow, fast, key, div, state)
    elif algorithm == "hierarchical":
        raise ValueError(
            "jc.psum: algorithm='hierarchical' needs axis_name=(slow_axis, fast_axis), "
            "e.g. ('node', 'local')"
        )
    else:
        size = axis_size(axis_name)  # a clear error for an unbound name
        state = _check_state(state, codec, flat.size, x.dtype, size, algorithm)
        div = size if mean else 1
        key = device_key(codec, key, axis_name)
        total, sent, state = _reduce(codec, flat, axis_name, algorithm, key, div, state)
    return Reduced(total.astype(x.dtype).reshape(x.shape), sent.reshape(x.shape), state)


def psum(
    x: jax.Array,
    axis_name,
    codec: Codec,
    *,
    key: jax.Array | None = None,
    algorithm: str = "auto",
    state: jax.Array | None = None,
) -> Reduced:
    """Compressed sum of ``x`` over the mesh axis ``axis_name``.

    Call inside ``jax.shard_map`` (or ``jax.pmap``).

    Algorithms that compress twice (two-phase, ring, the sparse split, and
    hierarchical through them) have a second stage whose error belongs to no
    device's input. Pass ``state`` (this device's server residual, from
    :func:`init_state`; carry ``Reduced.state`` to the next call) to keep
    that error where it was made, at the scale of what that stage
    compresses: two-level error feedback. Without it the error is charged
    to ``sent`` at the scale of the sum (one-level).

    Args:
      x: this device's tensor (float32, bfloat16 or float16, any shape).
      axis_name: the mesh axis to reduce over, or ``(slow, fast)`` axes for
        the hierarchical algorithm.
      codec: a :mod:`jaxcomp.codecs` codec (or its spec string, "qsgd:bits=4").
      key: a PRNG key, required by stochastic codecs; it is folded with the
        device index, so pass the same key on every device.
      algorithm: "auto" (see :func:`choose_algorithm`), "allgather",
        "two_phase", "ring", "sparse", "allreduce" or "hierarchical".
      state: None, or this device's server residual: float32 of
        :func:`state_size` elements, in units of the sum.
    Returns:
      :class:`Reduced` (value, sent, state).
    """
    return _all_reduce(x, axis_name, codec, key, algorithm, mean=False, state=state)


def pmean(x, axis_name, codec: Codec, *, key=None, algorithm: str = "auto", state=None) -> Reduced:
    """Compressed mean of ``x`` over the mesh axis ``axis_name``.

    Like :func:`psum`, with the sum divided by the number of devices before
    its last compression (so the mean costs no extra pass).

    Args:
      x: this device's tensor (float32, bfloat16 or float16, any shape).
      axis_name: the mesh axis, or ``(slow, fast)`` axes (hierarchical).
      codec: a :mod:`jaxcomp.codecs` codec (or its spec string, "qsgd:bits=4").
      key: a PRNG key, required by stochastic codecs (the same on every
        device).
      algorithm: as in :func:`psum`.
      state: as in :func:`psum`, in units of the mean.
    Returns:
      :class:`Reduced`: ``value`` the mean, ``sent`` (as in :func:`psum`)
      this device's compressed contribution to the *sum*, ``state`` the new
      server residual (or None).
    """
    return _all_reduce(x, axis_name, codec, key, algorithm, mean=True, state=state)


def state_size(codec: Codec, n: int, dtype, axis_sizes, algorithm: str = "auto") -> int:
    """Elements of the server residual one device keeps for a compressed
    all-reduce of ``n`` values (two-level error feedback; see :func:`psum`).

    - two-phase: the chunk the device owns (``chunk_len``, about ``n / P``);
    - ring: one chunk (``ceil(n / P)``) per scatter-reduce step and one for
      the owner's last compression, ``P`` chunks in all (about ``n``): at
      step s a device sends chunk ``d - s``, so the rows cover every chunk
      once;
    - sparse: the owned range of the split algorithm's dense stage, 0 for the
      static sparse all-reduce;
    - allgather, allreduce, one device: 0 (one compression, nothing for a
      server to keep);
    - hierarchical ``(slow, fast)``: that of the slow-axis all-reduce of a
      ``ceil(n / fast)`` chunk (by the ``auto`` rule).

    Args:
      codec: the codec.
      n: elements of the tensor.
      dtype: its dtype.
      axis_sizes: the axis size, or ``(slow, fast)`` sizes.
      algorithm: one of :data:`ALGORITHMS`.
    Returns:
      The number of float32 elements.
    """
    sizes = tuple(axis_sizes) if isinstance(axis_sizes, (tuple, list)) else (axis_sizes,)
    if len(sizes) == 2:
        slow, fast = sizes
        return state_size(codec, -(-n // fast) if n else 0, dtype, slow, "auto")
    (p,) = sizes
    if p == 1 or n == 0:
        return 0
    algorithm = _resolve(codec, n, p, algorithm)
    if algorithm == "two_phase":
        return chunk_len(codec, n, p)
    if algorithm == "ring":
        return p * -(-n // p)
    if algorithm == "sparse":
        return 0 if _sparse.static_fits(codec, n, dtype, p) else -(-n // p)
    if algorithm in ("allgather", "allreduce"):
        return 0
    raise ValueError(f"jc.collectives.state_size: unknown algorithm {algorithm!r}")


def state_positions(codec: Codec, n: int, dtype, axis_sizes, algorithm: str = "auto") -> np.ndarray:
    """Where each device's server residual lies in the flat tensor.

    Args:
      codec, n, dtype, axis_sizes, algorithm: as in :func:`state_size`.
    Returns:
      int64 ``[devices, state_size]``: the index into the flattened tensor
      of every element of every device's state, -1 for padding past ``n``.
      Devices are in mesh order (for ``(slow, fast)`` axes, slow-major).
      Adding ``div * state`` at these positions, over the devices, gives the
      part of the result that the states still hold back.
    """
    sizes = tuple(axis_sizes) if isinstance(axis_sizes, (tuple, list)) else (axis_sizes,)
    if len(sizes) == 2:
        slow, fast = sizes
        cf = -(-n // fast) if n else 0
        inner = state_positions(codec, cf, dtype, slow, "auto")  # [slow, m]
        rows = []
        for i in range(slow):
            for j in range(fast):
                pos = np.where(inner[i] >= 0, inner[i] + j * cf, -1)
                rows.append(np.where(pos < n, pos, -1))
        return np.asarray(rows, np.int64).reshape(slow * fast, -1)
    (p,) = sizes
    m = state_size(codec, n, dtype, p, algorithm)
    if m == 0:
        return np.zeros((p, 0), np.int64)
    algorithm = _resolve(codec, n, p, algorithm)
    if algorithm == "ring":
        c = m // p
        order = [[(d - s) % p for s in range(p - 1)] + [(d + 1) % p] for d in range(p)]
        chunks = np.asarray(order, np.int64)[:, :, None] * c + np.arange(c)
        pos = chunks.reshape(p, m)
    else:  # two_phase, the sparse split: device d owns [d m, (d + 1) m)
        pos = np.arange(p, dtype=np.int64)[:, None] * m + np.arange(m)
    return np.where(pos < n, pos, -1)


def init_state(codec: Codec, shape, dtype, axis_sizes, algorithm: str = "auto") -> jax.Array:
    """A zero server residual for :func:`psum` / :func:`pmean` (one device's).

    Args:
      codec: the codec.
      shape: the tensor's shape.
      dtype: its dtype.
      axis_sizes: the axis size, or ``(slow, fast)`` sizes.
      algorithm: the algorithm the calls will use.
    Returns:
      float32 zeros of :func:`state_size` elements.
    """
    n = int(np.prod(shape, dtype=np.int64))
    return jnp.zeros((state_size(codec, n, dtype, axis_sizes, algorithm),), jnp.float32)


def operand_nbytes(codec: Codec, shape, dtype, axis_size: int, algorithm: str) -> dict[str, int]:
    """Bytes this device hands to each kind of collective, as the compiled
    HLO shows them.

    Every size comes from the codec's layout
    (:meth:`~jaxcomp.codecs.Codec.wire_nbytes`). Variable-rate codecs and the
    split sparse algorithm move their payloads in capacity tiers chosen at
    run time; for them this is the largest tier (an upper bound;
    :func:`tier_capacities` lists the tiers).

    Args:
      codec: the codec.
      shape: the tensor's shape.
      dtype: its dtype.
      axis_size: devices on the axis.
      algorithm: one of :data:`ALGORITHMS` but "hierarchical".
    Returns:
      ``{kind: bytes}`` with kind "all-gather", "all-to-all",
      "collective-permute" or "all-reduce" (empty for one device).
    """
    n = int(np.prod(shape, dtype=np.int64))
    algorithm = _resolve(codec, n, axis_size, algorithm)
    if axis_size == 1:
        return {}
    if algorithm == "hierarchical":
        raise ValueError(
            "operand_nbytes: the hierarchical algorithm has two axes; not supported here"
        )
    if algorithm == "sparse":
        return _sparse.operand_nbytes(codec, n, dtype, axis_size)
    if algorithm in ("allgather", "allreduce"):
        kind = "all-gather" if algorithm == "allgather" else "all-reduce"
        return {kind: codec.wire_nbytes((n,), dtype)}
    if algorithm == "two_phase":
        chunk = codec.wire_nbytes((chunk_len(codec, n, axis_size),), dtype)
        return {"all-to-all": axis_size * chunk, "all-gather": chunk}
    if algorithm == "ring":
        chunk = codec.wire_nbytes((-(-n // axis_size) if n else 0,), dtype)
        return {"collective-permute": 2 * (axis_size - 1) * chunk}
    raise ValueError(f"unknown algorithm {algorithm!r}")


def send_nbytes(codec: Codec, n: int, dtype, axis_sizes, algorithm: str = "auto") -> float:
    """Bytes one device sends over the network in a compressed all-reduce.

    ``(P-1)`` times an all-gather operand, ``(P-1)/P`` of an all-to-all
    operand, every byte of a collective-permute, and ``2 (P-1)/P`` of an
    all-reduce operand (a ring all-reduce); an upper bound for capacity
    tiers.

    Args:
      codec: the codec.
      n: elements of the tensor.
      dtype: its dtype.
      axis_sizes: the axis size, or ``(slow, fast)`` sizes for the
        hierarchical algorithm (float32 over the fast axis, compressed over
        the slow one).
      algorithm: one of :data:`ALGORITHMS` ("auto" by default).
    Returns:
      Bytes (a float: the all-to-all share is fractional).
    """
    sizes = tuple(axis_sizes) if isinstance(axis_sizes, (tuple, list)) else (axis_sizes,)
    if len(sizes) == 2:
        slow, fast = sizes
        chunk = -(-n // fast)
        return uncompressed_send_nbytes(4 * n, fast) + send_nbytes(codec, chunk, dtype, slow)
    (p,) = sizes
    total = 0.0
    for kind, op in operand_nbytes(codec, (n,), dtype, p, algorithm).items():
        if kind == "all-gather":
            total += (p - 1) * op
        elif kind == "all-to-all":
            total += (p - 1) / p * op
        elif kind == "all-reduce":
            total += uncompressed_send_nbytes(op, p)
        else:  # collective-permute: every operand byte is sent
            total += op
    return total


def uncompressed_send_nbytes(nbytes: int, axis_size: int) -> float:
    """Bytes one device sends in a ring all-reduce, what ``lax.psum`` costs
    on the network.

    Args:
      nbytes: bytes of the tensor.
      axis_size: devices on the axis.
    Returns:
      ``2 (P-1)/P * nbytes`` (0 for one device).
    """
    p = axis_size
    return 2.0 * (p - 1) / p * nbytes if p > 1 else 0.0
