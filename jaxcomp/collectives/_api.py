"""The public functions: compressed psum/pmean and their accounting.

Each converts what it is given (``axis_name``, ``axis_sizes``, a codec's
spec string) once, into an :class:`~jaxcomp._axes.Axes` and a codec, and
hands over to the algorithm protocol (:mod:`._algorithm`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp._axes import Axes
from jaxcomp.codecs.base import Codec, as_codec
from jaxcomp.collectives import _algorithm, _scatter
from jaxcomp.collectives._algorithm import Context
from jaxcomp.collectives._exchange import check_all_to_all
from jaxcomp.collectives._keys import device_key


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


def _bind(axis_name, algorithm: str) -> Axes:
    """``axis_name`` as bound axes, checked against ``algorithm``: a tuple
    of two names means the algorithm of two axes."""
    alg = _algorithm.get(algorithm)
    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 2 or (alg is not None and alg.num_axes != 2):
            raise ValueError(
                "jc.psum: a tuple of axis names means the hierarchical algorithm over "
                "(slow, fast) axes, e.g. ('node', 'local'); got "
                f"axis_name={axis_name!r}, algorithm={algorithm!r}"
            )
    elif alg is not None and alg.num_axes == 2:
        raise ValueError(
            f"jc.psum: algorithm={algorithm!r} needs axis_name=(slow_axis, fast_axis), "
            "e.g. ('node', 'local')"
        )
    return Axes.bound(axis_name, "jc.psum")


def _check_state(state, codec: Codec, n: int, dtype, axes: Axes, algorithm: str):
    if state is None:
        return None
    want = _algorithm.state_size(codec, n, dtype, axes, algorithm)
    shape = getattr(state, "shape", None)
    if shape != (want,) or state.dtype != jnp.float32:
        got = f"{state.dtype.name}{list(shape)}" if shape is not None else type(state).__name__
        raise ValueError(
            f"jc.psum: state must be float32[{want}] for {codec!r} over {n} values with "
            f"algorithm={algorithm!r} on axes of sizes {axes.axis_sizes} "
            f"(jc.collectives.init_state), got {got}"
        )
    return state


def _prepare(x, axis_name, codec, key, algorithm, mean: bool, state, dep=None, a2a="auto"):
    """The checked input, flat, its state and the call's context."""
    if algorithm not in _algorithm.names():
        raise ValueError(
            f"jc.psum: algorithm must be one of {_algorithm.names()}, got {algorithm!r}"
        )
    check_all_to_all(a2a, "jc.psum")
    codec = as_codec(codec, "jc.psum")  # a codec, its class or its spec string
    x = codec.check_input(x)
    flat = x.reshape(-1)
    axes = _bind(axis_name, algorithm)
    state = _check_state(state, codec, flat.size, x.dtype, axes, algorithm)
    ctx = Context(codec, axes, device_key(codec, key, axes), axes.size if mean else 1, dep, a2a)
    return x, flat, state, ctx


def _all_reduce(x, axis_name, codec, key, algorithm, mean: bool, state, a2a) -> Reduced:
    x, flat, state, ctx = _prepare(x, axis_name, codec, key, algorithm, mean, state, None, a2a)
    total, sent, state = _algorithm.all_reduce(ctx, flat, algorithm, state)
    return Reduced(total.astype(x.dtype).reshape(x.shape), sent.reshape(x.shape), state)


def pmean_feedback(
    x,
    residual,
    axis_name,
    codec,
    *,
    key=None,
    algorithm="auto",
    state=None,
    after=None,
    all_to_all="auto",
    mean: bool = True,
):
    """``pmean(x + residual)`` (``psum`` with ``mean=False``) under error
    feedback: ``(value, kept, state)``, ``kept`` the new residual ``x +
    residual - sent`` (float32, ``x``'s shape) in ``sent``'s place.

    ``x`` and ``residual`` are flat; the float32 sum is formed in the
    first compression (``Algorithm.run_feedback``): by the codec's one-pass
    kernel where it has one on the CPU, so neither the sum nor what this
    device sent is written out. The first collective waits for ``after``
    (:func:`~jaxcomp.collectives.after`), tied where it costs least: the
    payload of a one-pass compression, else the sum that is formed.
    ``all_to_all``: as in :func:`psum`."""
    x, flat, state, ctx = _prepare(
        x, axis_name, codec, key, algorithm, mean, state, after, all_to_all
    )
    total, kept, state = _algorithm.all_reduce_feedback(ctx, flat, residual, algorithm, state)
    return total.astype(x.dtype), kept, state


def psum(
    x: jax.Array,
    axis_name,
    codec: Codec,
    *,
    key: jax.Array | None = None,
    algorithm: str = "auto",
    state: jax.Array | None = None,
    all_to_all: str = "auto",
) -> Reduced:
    """Compressed sum of ``x`` over the mesh axis ``axis_name``.

    Call inside ``jax.shard_map`` (or ``jax.pmap``). Algorithms that compress
    twice have a second stage whose error belongs to no device's input:
    pass ``state`` (from :func:`init_state`; carry ``Reduced.state`` to the
    next call) to keep it where it was made (two-level error feedback);
    without it the error is charged to ``sent`` (one-level).
    docs/collectives.md has the algorithms and their bytes.

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
      all_to_all: how the all-to-all of ``two_phase`` and the split
        ``sparse`` travels: "native" (``lax.all_to_all``), "pairwise"
        (``P - 1`` rounds of ``ppermute``) or "auto" (pairwise across
        processes of the CPU backend, native elsewhere).
    Returns:
      :class:`Reduced` (value, sent, state).
    """
    return _all_reduce(x, axis_name, codec, key, algorithm, False, state, all_to_all)


def pmean(
    x,
    axis_name,
    codec: Codec,
    *,
    key=None,
    algorithm: str = "auto",
    state=None,
    all_to_all: str = "auto",
) -> Reduced:
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
      all_to_all: as in :func:`psum`.
    Returns:
      :class:`Reduced`: ``value`` the mean, ``sent`` (as in :func:`psum`)
      this device's compressed contribution to the *sum*, ``state`` the new
      server residual (or None).
    """
    return _all_reduce(x, axis_name, codec, key, algorithm, True, state, all_to_all)


def choose_algorithm(codec: Codec, n: int, axis_size) -> str:
    """The rule behind ``algorithm="auto"``: what trains best at the fewest
    bytes, per codec (the table in docs/collectives.md). ``(slow, fast)``
    axes take the algorithm of two axes (``hierarchical``); over one axis
    each algorithm declares its part (``Algorithm.chosen``), and they are
    asked in this order:

    - Linear codecs (``Rate.LINEAR``, e.g. Identity): ``allreduce``, one
      ``psum`` of the payloads.
    - Sparse codecs (``Rate.SPARSE``, TopK): ``sparse``, SparCML's algorithms
      (static sparse all-reduce or DSAR_Split_allgather by the density rule
      of its section 5.1: see :func:`sparse_is_static`).
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
      axis_size: devices on the axis, or ``(slow, fast)`` sizes.
    Returns:
      The algorithm's name.
    """
    return _algorithm.choose(codec, n, Axes.of_sizes(axis_size)).name


def recompression_warning(codec: Codec, algorithm: str) -> str | None:
    """Why ``codec`` should not be trained with error feedback through
    ``algorithm`` (a dense algorithm that compresses twice), or None."""
    alg = _algorithm.get(algorithm)
    return None if alg is None else alg.recompression_warning(codec)


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
    return _algorithm.state_size(codec, n, dtype, Axes.of_sizes(axis_sizes), algorithm)


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
    return _algorithm.state_positions(codec, n, dtype, Axes.of_sizes(axis_sizes), algorithm)


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
    return _algorithm.operand_nbytes(codec, n, dtype, Axes.of_sizes(axis_size), algorithm)


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
    return _algorithm.send_nbytes(codec, n, dtype, Axes.of_sizes(axis_sizes), algorithm)


# ---------------------------------------------------------------------------
# The collectives of sharded training
# ---------------------------------------------------------------------------
def psum_scatter(
    x: jax.Array,
    axis_name,
    codec: Codec,
    *,
    key: jax.Array | None = None,
    tiled: bool = False,
    state: None = None,
    all_to_all: str = "auto",
) -> Reduced:
    """Compressed reduce-scatter of ``x`` over dimension 0, like
    ``lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=tiled)``.

    Call inside ``jax.shard_map`` (or ``jax.pmap``). Every element is
    quantized once, by its sender: this device encodes its tensor once, an
    all-to-all hands every device the payloads of its row, and it decodes
    and sums them in float32, in device order. Over ``(slow, fast)`` axes
    only the slow hop is compressed. docs/collectives.md, "Reduce-scatter
    and all-gather".

    Args:
      x: this device's tensor (float32, bfloat16 or float16); ``x.shape[0]``
        is the number of devices ``P`` (``tiled=True``: a multiple of it).
      axis_name: the mesh axis, or ``(slow, fast)`` axes.
      codec: a fixed-size codec or Identity, or its spec string
        (variable-rate and sparse codecs are refused).
      key: a PRNG key, required by stochastic codecs (the same on every device).
      tiled: as in ``lax.psum_scatter``.
      state: must be None (there is no server residual; error feedback:
        :func:`psum_scatter_feedback`).
      all_to_all: as in :func:`psum`.
    Returns:
      :class:`Reduced`: ``value`` this device's row of the sum, in ``x``'s
      dtype; ``sent`` float32 of ``x``'s shape, what ``x`` became after its
      compression, so that the rows ``sent`` holds for device ``j``, summed
      over the devices, equal ``j``'s ``value``; ``state`` None.
    Raises:
      ValueError: ``state`` is not None, or ``x`` or ``codec`` does not fit.
    """
    if state is not None:
        raise ValueError(
            "jc.psum_scatter: state must be None: every element is compressed once, by its "
            "sender, so there is no server residual (error feedback keeps the sender's own "
            "residual: jc.collectives.psum_scatter_feedback)"
        )
    value, sent = _scatter.scatter(x, axis_name, codec, key=key, tiled=tiled, all_to_all=all_to_all)
    return Reduced(value, sent, None)


def all_gather(
    x: jax.Array, axis_name, codec: Codec, *, key: jax.Array | None = None, tiled: bool = False
) -> jax.Array:
    """Compressed all-gather of ``x``, like ``lax.all_gather(x, axis_name,
    tiled=tiled)``.

    Call inside ``jax.shard_map`` (or ``jax.pmap``). This device encodes
    ``x`` once; the payload is all-gathered (one collective for all its
    arrays; over ``(slow, fast)`` axes over ``slow``, then the gathered
    payloads over ``fast``) and every row is decoded from the payloads,
    this device's own included, so every device holds the same bits.
    Identity is ``lax.all_gather`` itself.

    Args:
      x: this device's tensor (float32, bfloat16 or float16).
      axis_name: the mesh axis, or ``(slow, fast)`` axes (device
        ``s * fast + f``, as ``lax.all_gather`` over both orders them).
      codec: as in :func:`psum_scatter`.
      key: a PRNG key, required by stochastic codecs (the same on every
        device).
      tiled: as in ``lax.all_gather``: concatenate along dimension 0
        instead of stacking.
    Returns:
      ``[P, *x.shape]`` (tiled: ``[P * x.shape[0], *x.shape[1:]]``) in
      ``x``'s dtype: every device's decoded payload.
    """
    return _scatter.all_gather(x, axis_name, codec, key=key, tiled=tiled)


def scatter_nbytes(codec: Codec, shape, dtype, axis_sizes) -> dict[str, int]:
    """Bytes this device hands to each kind of collective in
    :func:`psum_scatter`, as the compiled HLO shows them.

    Args:
      codec: the codec.
      shape: the shape of ``x`` (before the scatter).
      dtype: its dtype.
      axis_sizes: the axis size, or ``(slow, fast)`` sizes.
    Returns:
      ``{kind: bytes}``: "all-to-all" (the payloads, ``P`` rows of
      ``x.size / P`` values padded to the codec's split granularity), over
      ``(slow, fast)`` axes also "reduce-scatter" (the float32 fast hop);
      Identity: "reduce-scatter" of ``x``.
    """
    return _scatter.shape_nbytes(_scatter.REDUCE_SCATTER, codec, shape, dtype, axis_sizes)


def gather_nbytes(codec: Codec, shape, dtype, axis_sizes) -> dict[str, int]:
    """Bytes this device hands to the all-gathers of :func:`all_gather`,
    as the compiled HLO shows them (the operand, not the gathered result).

    Args:
      codec, dtype, axis_sizes: as in :func:`scatter_nbytes`.
      shape: the shape of ``x``.
    Returns:
      ``{"all-gather": bytes}``: one payload of ``x``; over ``(slow,
      fast)`` axes that plus the ``slow`` payloads forwarded over ``fast``.
    """
    return _scatter.shape_nbytes(_scatter.ALL_GATHER, codec, shape, dtype, axis_sizes)
