"""The compressed reduce-scatter and all-gather of sharded training.

The reduce-scatter quantizes every element once on the wire: each device
encodes its whole tensor (one payload per owner's row), an all-to-all hands
every owner the payloads of its row, and the owner decodes and sums them in
float32 (:func:`~jaxcomp.collectives._decode.decode_sum`). A ring
reduce-scatter would re-quantize partial sums at every hop, and that error
belongs to no device's input, so error feedback could not return it; here
every error is the sender's own.

Over ``(slow, fast)`` axes the reduce-scatter is two hops: an exact float32
``lax.psum_scatter`` over ``fast``, then the compressed reduce-scatter over
``slow`` of the partial sums. The all-gather encodes once, gathers the
payload over ``slow`` then forwards the gathered payloads over ``fast``,
and decodes every row at the end, this device's own included, so that every
device holds the same bits.

:class:`ReduceScatter` and :class:`AllGather` declare their bytes and
kernel calls as the all-reduce algorithms do (:class:`~jaxcomp.collectives.
Algorithm`), but they are not all-reduces and are not registered:
``jc.psum(algorithm=...)`` does not take them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._axes import Axes
from jaxcomp.codecs.base import Codec, Rate, as_codec
from jaxcomp.collectives._algorithm import Algorithm, Collective, KernelCall
from jaxcomp.collectives._chunks import split
from jaxcomp.collectives._decode import decode_own, decode_rows, decode_sum
from jaxcomp.collectives._exchange import check_all_to_all, exchange
from jaxcomp.collectives._keys import fold
from jaxcomp.collectives.feedback import accumulate, compress_kept, kept
from jaxcomp.payload import Payload

#: The codec rates the two collectives take.
RATES = (Rate.FIXED, Rate.LINEAR)


# ---------------------------------------------------------------------------
# Checks and shapes
# ---------------------------------------------------------------------------
def _codec(codec: Any, who: str) -> Codec:
    codec = as_codec(codec, who)
    if codec.rate not in RATES:
        raise ValueError(
            f"{who}: {codec!r} is a {codec.rate.value}-rate codec; the compressed reduce-scatter "
            "and all-gather take fixed-size codecs (QSGD, Int8, OneBit, SignSGD, TernGrad, "
            "Natural, FP8, MX, Cast) and Identity. Use one of those, or jc.psum for this codec."
        )
    return codec


def _axes(axis_name: Any, who: str) -> Axes:
    if isinstance(axis_name, (tuple, list)) and len(axis_name) != 2:
        raise ValueError(
            f"{who}: axis_name is one mesh axis or (slow, fast) axes, got {axis_name!r}"
        )
    return Axes.bound(axis_name, who)


def _key(codec: Codec, key, axes: Axes, who: str):
    """This device's key: the caller's folded with the device's index over
    the axes (slow-major), so devices draw independent bits."""
    if not codec.stochastic:
        return None
    if key is None:
        raise ValueError(
            f"{who}: {codec!r} is stochastic and needs key= (a PRNG key, the same on every device)"
        )
    return jax.random.fold_in(key, axes.index())


def _result_shape(shape: tuple[int, ...], p: int, tiled: bool, who: str) -> tuple[int, ...]:
    """The shape a reduce-scatter of ``shape`` over ``p`` devices returns."""
    if not shape:
        raise ValueError(f"{who}: x must have a leading dimension to scatter, got a scalar")
    if tiled:
        if shape[0] % p:
            raise ValueError(
                f"{who}: with tiled=True, x.shape[0] must be a multiple of the {p} devices on "
                f"the axes, got x.shape={shape}; pad dimension 0 to a multiple of {p}"
            )
        return (shape[0] // p, *shape[1:])
    if shape[0] != p:
        raise ValueError(
            f"{who}: with tiled=False, x.shape[0] must equal the {p} devices on the axes, got "
            f"x.shape={shape}; reshape x to ({p}, -1, ...) or pass tiled=True"
        )
    return tuple(shape[1:])


def _row_len(codec: Codec, k: int) -> int:
    """A row of ``k`` values, padded to the codec's split granularity (where
    it has one) so that one encoding of the rows cuts into one payload per
    row."""
    g = codec.split_granularity()
    return -(-k // g) * g if g else k


def _pad_rows(rows: jax.Array, kp: int) -> jax.Array:
    k = rows.shape[-1]
    return rows if k == kp else jnp.pad(rows, ((0, 0), (0, kp - k)))


# ---------------------------------------------------------------------------
# One compression of every row, then the all-to-all and the decode-and-sum
# ---------------------------------------------------------------------------
def _encode_rows(codec: Codec, rows: jax.Array, residual, key, dtype):
    """Rows ``[P, k]`` (plus a float32 ``residual`` of their shape), each
    compressed once: ``(payloads, own)``, the stacked payloads of the rows
    padded to :func:`_row_len` and ``own`` float32 ``[P, k]``: what they
    decode to or, with a ``residual``, what the rows kept (``acc -
    decoded``)."""
    p, k = rows.shape
    kp = _row_len(codec, k)
    if codec.split_granularity():
        # One encoding of all the rows, cut into one payload per owner.
        flat = _pad_rows(rows, kp).reshape(-1)
        if residual is None:
            payload = codec.encode(flat, key)
            own = decode_own(payload)
        else:
            payload, own = compress_kept(
                codec, flat, _pad_rows(residual, kp).reshape(-1), key, dtype
            )
        return split(payload, p), own.reshape(p, kp)[:, :k]
    # A whole-tensor codec: one encode per row, with a key per row.
    acc = rows if residual is None else accumulate(rows, residual)
    keys = None if key is None else jax.vmap(lambda j: fold(key, j))(jnp.arange(p))
    payloads = jax.vmap(codec.encode)(acc.astype(dtype), keys)
    hat = decode_rows(payloads, fused=True)
    return payloads, (hat if residual is None else kept(acc, hat))


def _scatter_rows(codec, rows, residual, axis, key, dtype, a2a):
    """The compressed reduce-scatter of ``rows`` ``[P, k]`` over ``axis``
    (one name): ``(mine, own)``, ``mine`` float32 ``[k]`` the sum over the
    devices of their rows for me, ``own`` as :func:`_encode_rows`'."""
    k = rows.shape[1]
    payloads, own = _encode_rows(codec, rows, residual, key, dtype)
    mine = decode_sum(exchange(payloads, "all-to-all", axis, a2a))
    return mine[:k], own


def _to_fast_major(rows: jax.Array, s: int, f: int) -> jax.Array:
    """Rows ``[S*F, k]`` in device order (``s*F + f``) as ``[F, S*k]``:
    chunk ``f`` holds the rows of the devices ``(., f)``, slow-major."""
    k = rows.shape[1]
    return rows.reshape(s, f, k).transpose(1, 0, 2).reshape(f, s * k)


def reduce_scatter_rows(
    codec: Codec, rows: jax.Array, residual, axes: Axes, key, dtype, a2a: str
) -> tuple[jax.Array, jax.Array]:
    """The reduce-scatter of this device's ``rows`` (``[P, k]``, row ``j``
    for device ``j``) over ``axes``, compressed as ``dtype`` (``x``'s) over
    one axis; over ``(slow, fast)`` the slow hop compresses the float32
    partial sums as float32.

    Returns:
      ``(value, own)``: ``value`` float32 ``[k]``, the sum over the devices
      of their row for this device; without a ``residual``, ``own`` float32
      ``[P, k]`` what this device's rows became (``sent``); with one
      (float32, one axis: ``[P, k]``; ``(slow, fast)``: ``[S, k]``, the slow
      hop's input), ``own`` the new residual, of the residual's shape.
    """
    if not axes.hierarchical:
        return _scatter_rows(codec, rows, residual, axes.name, key, dtype, a2a)
    s, f = axes.sizes
    k = rows.shape[1]
    x32 = rows.astype(jnp.float32)
    # Exact float32 over the fast axis: my chunk of the node's sum, [S, k],
    # whose row s belongs to device (s, me_fast).
    partial = lax.psum_scatter(
        _to_fast_major(x32, s, f), axes.fast.name, scatter_dimension=0, tiled=False
    ).reshape(s, k)
    # The partial sums are compressed as they are, in float32.
    mine, own = _scatter_rows(codec, partial, residual, axes.slow.name, key, jnp.float32, a2a)
    if residual is not None:
        return mine, own
    # The slow hop's error is mine, on the rows of my fast chunk.
    error = (own - partial)[:, None, :]
    me = lax.axis_index(axes.fast.name)
    sent = lax.dynamic_update_slice(
        x32.reshape(s, f, k),
        lax.dynamic_slice(x32.reshape(s, f, k), (0, me, 0), (s, 1, k)) + error,
        (0, me, 0),
    )
    return mine, sent.reshape(s * f, k)


# ---------------------------------------------------------------------------
# The all-gather
# ---------------------------------------------------------------------------
def gather_payload(payload: Payload, axes: Axes) -> jax.Array:
    """This device's payload all-gathered over ``axes`` and every row
    decoded: float32 ``[P, n]`` in device order (slow-major)."""
    if not axes.hierarchical:
        return decode_rows(exchange(payload, "all-gather", axes.name), fused=True)
    s, f = axes.sizes
    # Over the slow axis, then the gathered payloads forwarded over the fast one.
    got = exchange(exchange(payload, "all-gather", axes.slow.name), "all-gather", axes.fast.name)
    rows = got.map(lambda a: a.reshape(f * s, *a.shape[2:]))
    hat = decode_rows(rows, fused=True)  # [F*S, n], fast-major
    n = hat.shape[1]
    return hat.reshape(f, s, n).transpose(1, 0, 2).reshape(s * f, n)


# ---------------------------------------------------------------------------
# Entry points (the public functions are in _api.py)
# ---------------------------------------------------------------------------
_PSUM_SCATTER = "jc.psum_scatter"
_FEEDBACK = "jc.collectives.psum_scatter_feedback"
_ALL_GATHER = "jc.all_gather"


def _prepare(x, axis_name, codec, key, tiled, a2a, who):
    check_all_to_all(a2a, who)
    codec = _codec(codec, who)
    x = codec.check_input(x)
    axes = _axes(axis_name, who)
    out_shape = _result_shape(x.shape, axes.size, tiled, who)
    return x, codec, axes, out_shape, _key(codec, key, axes, who)


def scatter(x, axis_name, codec, *, key=None, tiled=False, all_to_all="auto"):
    """``(value, sent)`` of :func:`jaxcomp.collectives.psum_scatter` (its
    docstring says what)."""
    who = _PSUM_SCATTER
    x, codec, axes, out_shape, dkey = _prepare(x, axis_name, codec, key, tiled, all_to_all, who)
    if codec.rate is Rate.LINEAR:
        value = lax.psum_scatter(x, axes.name, scatter_dimension=0, tiled=tiled)
        return value, x.astype(jnp.float32)
    rows = x.reshape(axes.size, -1)
    mine, sent = reduce_scatter_rows(codec, rows, None, axes, dkey, x.dtype, all_to_all)
    return mine.astype(x.dtype).reshape(out_shape), sent.reshape(x.shape)


def feedback_size(codec, n: int, axis_sizes) -> int:
    """Elements of the sender residual of error feedback for a
    reduce-scatter of ``n`` values (the whole tensor before the scatter).

    Over one axis, ``n``: every row the device compresses, since each
    sender's error is its own and no other device can know it. Over
    ``(slow, fast)`` axes, ``n // fast``: only the slow hop compresses, and
    its input is this device's ``[S, n / P]`` partial sums.

    Args:
      codec: the codec (or its spec string).
      n: elements of the tensor before the scatter (a multiple of the
        devices).
      axis_sizes: the axis size, or ``(slow, fast)`` sizes.
    Returns:
      The number of float32 elements.
    """
    _codec(codec, "jc.collectives.feedback_size")
    axes = Axes.of_sizes(axis_sizes)
    if n % axes.size:
        raise ValueError(
            f"jc.collectives.feedback_size: n={n} is not a multiple of the {axes.size} devices"
        )
    return n // axes.sizes[1] if axes.hierarchical else n


def psum_scatter_feedback(
    x, residual, axis_name, codec, *, key=None, tiled=False, all_to_all="auto"
):
    """The reduce-scatter of ``acc = x + residual`` under error feedback.

    Args:
      x: this device's tensor, as :func:`psum_scatter` takes it.
      residual: float32, flat, :func:`feedback_size` elements: what this
        device's earlier compressions missed. One axis: of the whole ``x``
        (flattened); ``(slow, fast)``: of the slow hop's input, this
        device's ``[S, x.size / P]`` partial sums over the fast axis (row
        ``s`` is what goes to device ``(s, this fast index)``).
      axis_name, codec, key, tiled, all_to_all: as in :func:`psum_scatter`.
    Returns:
      ``(value, new_residual)``: ``value`` as :func:`psum_scatter`'s (the
      sum of the compressed accumulations, ``x``'s dtype, the result
      shape); ``new_residual`` float32 flat: what ``acc`` kept, ``acc -
      decoded``. Where the codec splits at a granularity, the payload and
      the new residual come out of one pass (:func:`compress_kept`).
    """
    who = _FEEDBACK
    x, codec, axes, out_shape, dkey = _prepare(x, axis_name, codec, key, tiled, all_to_all, who)
    want = feedback_size(codec, x.size, axes.sizes)
    shape = getattr(residual, "shape", None)
    if shape != (want,) or residual.dtype != jnp.float32:
        got = f"{residual.dtype.name}{list(shape)}" if shape is not None else type(residual)
        raise ValueError(
            f"{who}: residual must be float32[{want}] (feedback_size) for x of shape "
            f"{x.shape} on axes of sizes {axes.axis_sizes}, got {got}"
        )
    if codec.rate is Rate.LINEAR:
        if axes.hierarchical:
            s, f = axes.sizes
            rows = _to_fast_major(x.astype(jnp.float32).reshape(axes.size, -1), s, f)
            partial = lax.psum_scatter(rows, axes.fast.name, scatter_dimension=0, tiled=False)
            acc = partial.reshape(s, -1) + residual.reshape(s, -1)
            value = lax.psum_scatter(acc, axes.slow.name, scatter_dimension=0, tiled=False)
        else:
            acc = x.astype(jnp.float32) + residual.reshape(x.shape)
            value = lax.psum_scatter(acc, axes.name, scatter_dimension=0, tiled=tiled)
        return value.astype(x.dtype).reshape(out_shape), jnp.zeros_like(residual)
    rows = x.reshape(axes.size, -1)
    k = rows.shape[1]
    res = residual.reshape(axes.sizes[0] if axes.hierarchical else axes.size, k)
    mine, kept = reduce_scatter_rows(codec, rows, res, axes, dkey, x.dtype, all_to_all)
    return mine.astype(x.dtype).reshape(out_shape), kept.reshape(-1)


def all_gather(x, axis_name, codec, *, key=None, tiled=False):
    """:func:`jaxcomp.collectives.all_gather` (its docstring says what)."""
    who = _ALL_GATHER
    codec = _codec(codec, who)
    x = codec.check_input(x)
    axes = _axes(axis_name, who)
    if tiled and not x.shape:
        raise ValueError(f"{who}: tiled=True needs x with a leading dimension, got a scalar")
    if codec.rate is Rate.LINEAR:
        return lax.all_gather(x, axes.name, tiled=tiled)
    payload = codec.encode(x.reshape(-1), _key(codec, key, axes, who))
    rows = gather_payload(payload, axes).astype(x.dtype)
    if tiled:
        return rows.reshape(axes.size * x.shape[0], *x.shape[1:])
    return rows.reshape(axes.size, *x.shape)


# ---------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------
def _sent_bytes(c: Collective, p: int) -> float:
    """Bytes one device sends for one collective over ``p`` devices:
    ``(P-1)`` operands of an all-gather, ``(P-1)/P`` of an all-to-all's or
    a reduce-scatter's operand."""
    if c.kind == "all-gather":
        return (p - 1) * c.operand
    return (p - 1) / p * c.operand


class _Accounting(Algorithm):
    """What both collectives derive from :meth:`collectives`.

    Their collectives run over one axis each (``Collective.axis``), but
    Identity's: over ``(slow, fast)`` axes it is lax's collective over both
    axes at once, declared on axis 0, the slow links it crosses."""

    #: The codecs both take, as the planner reads it.
    planned_rates: ClassVar[frozenset[Rate]] = frozenset(RATES)

    def operand_nbytes(self, codec, n, dtype, axes):
        out: dict[str, int] = {}
        for c in self.collectives(codec, n, dtype, axes):
            out[c.kind] = out.get(c.kind, 0) + int(c.operand)
        return out

    def send_nbytes(self, codec, n, dtype, axes):
        both = as_codec(codec, "jc.collectives").rate is Rate.LINEAR
        colls = self.collectives(codec, n, dtype, axes)
        return sum((_sent_bytes(c, axes.size if both else axes.sizes[c.axis]) for c in colls), 0.0)


@dataclasses.dataclass(frozen=True)
class ReduceScatter(_Accounting):
    """The compressed reduce-scatter of ``n`` values (the tensor before the
    scatter, a multiple of the devices): one encode of every row, an
    all-to-all of the payloads, a decode-and-sum; over ``(slow, fast)``
    axes a float32 reduce-scatter over ``fast`` first."""

    name: ClassVar[str] = "reduce_scatter"

    def collectives(self, codec, n, dtype, axes, bits=None):
        codec = _codec(codec, "jc.collectives.scatter_nbytes")
        p = axes.size
        if n % p:
            raise ValueError(
                f"jc.collectives.scatter_nbytes: {n} values do not split over {p} devices"
            )
        if p == 1 and not axes.hierarchical:
            return []
        if codec.rate is Rate.LINEAR:
            return [Collective("reduce-scatter", n * jnp.dtype(dtype).itemsize)]
        k = n // p
        if not axes.hierarchical:
            return [Collective("all-to-all", p * _row_nbytes(codec, k, dtype))]
        s = axes.sizes[0]
        return [
            Collective("reduce-scatter", 4 * n, axis=1),
            Collective("all-to-all", s * _row_nbytes(codec, k, jnp.float32), axis=0),
        ]

    def kernel_calls(self, codec, n, dtype, axes):
        """Encode the rows (padded per row), decode-and-sum the received
        payloads of my row, decode my own payloads (for ``sent``; under
        error feedback a codec with a one-pass kernel makes the payloads and
        the residual together instead)."""
        codec = _codec(codec, "jc.collectives.scatter_kernel_calls")
        if codec.rate is Rate.LINEAR:
            return []
        p = axes.size
        rows = axes.sizes[0] if axes.hierarchical else p
        m = rows * _row_len(codec, n // p)
        return [
            KernelCall("encode", m, codec),
            KernelCall("decode", m, codec),
            KernelCall("decode", m, codec),
        ]

    def compressed_values(self, n, axes):
        return n // axes.sizes[1] if axes.hierarchical else n


@dataclasses.dataclass(frozen=True)
class AllGather(_Accounting):
    """The compressed all-gather of this device's ``n`` values: one encode,
    an all-gather of the payload (over ``slow``, then the gathered payloads
    over ``fast``), every row decoded."""

    name: ClassVar[str] = "all_gather"

    def collectives(self, codec, n, dtype, axes, bits=None):
        codec = _codec(codec, "jc.collectives.gather_nbytes")
        if codec.rate is Rate.LINEAR:
            if axes.size == 1 and not axes.hierarchical:
                return []
            return [Collective("all-gather", n * jnp.dtype(dtype).itemsize)]
        w = codec.wire_nbytes((n,), dtype)
        if not axes.hierarchical:
            return [] if axes.size == 1 else [Collective("all-gather", w)]
        return [
            Collective("all-gather", w, axis=0),
            Collective("all-gather", axes.sizes[0] * w, axis=1),
        ]

    def kernel_calls(self, codec, n, dtype, axes):
        """Encode mine; decode every device's payload."""
        codec = _codec(codec, "jc.collectives.gather_kernel_calls")
        if codec.rate is Rate.LINEAR:
            return []
        return [KernelCall("encode", n, codec), KernelCall("decode", axes.size * n, codec)]


def _row_nbytes(codec: Codec, k: int, dtype) -> int:
    """Wire bytes of one row's payload (padded as :func:`_row_len`)."""
    return codec.wire_nbytes((_row_len(codec, k),), dtype)


REDUCE_SCATTER = ReduceScatter()
ALL_GATHER = AllGather()


def shape_nbytes(alg: Algorithm, codec, shape, dtype, axis_sizes) -> dict[str, int]:
    """``alg``'s operand bytes for ``x`` of ``shape``, by kind
    (:func:`jaxcomp.collectives.scatter_nbytes`, ``gather_nbytes``)."""
    n = math.prod(int(d) for d in shape)
    return alg.operand_nbytes(codec, n, dtype, Axes.of_sizes(axis_sizes))
