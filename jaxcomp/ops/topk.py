"""TopK selection and scatter: FFI targets ``jaxcomp_topk_encode``/``_decode``
and their twins (ffi/include/jaxcomp/topk.h), plus the sparse-pair helpers the
sparse collectives build on (Renggli et al., "SparCML", SC19, section 5).

Ranking (every backend): an element's key is its absolute value's bits as an
unsigned integer (the storage word with the sign bit cleared). Keys order
magnitudes exactly and put NaN above +-Inf, so NaNs are always kept; among
equal keys the lower index wins. Chosen elements are listed by ascending
index; values are copied bit for bit.

``bucket == 0`` selects ``k`` elements of the whole tensor and stores global
indices. ``bucket > 0`` selects ``k`` of every bucket and stores bucket-local
indices, ``k`` entries per bucket; the last bucket, of length ``L < k``, lists
its ``L`` elements and then padding entries with local indices ``L .. k-1``
(global index ``>= n``) and value 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.ops._dispatch import dispatch, ffi_call


def index_dtype(limit: int) -> np.dtype:
    """Smallest unsigned integer dtype holding every index in ``[0, limit)``."""
    if limit <= 1 << 8:
        return np.dtype(np.uint8)
    if limit <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def num_entries(n: int, k: int, bucket: int) -> int:
    """Entries of a payload: ``k`` (whole tensor) or ``k`` per bucket."""
    return k if bucket == 0 else -(-n // bucket) * k


def _word(dtype) -> np.dtype:
    return np.dtype(np.uint32) if np.dtype(dtype).itemsize == 4 else np.dtype(np.uint16)


def _keys(words: jax.Array) -> jax.Array:
    """topk.h: topk_key, as int32 (keys fit in 31 bits)."""
    mask = 0x7FFFFFFF if words.dtype == jnp.uint32 else 0x7FFF
    return (words & np.array(mask, words.dtype)).astype(jnp.int32)


def encode_ref(x: jax.Array, *, k: int, bucket: int):
    n = x.size
    words = lax.bitcast_convert_type(x, _word(x.dtype))
    if bucket == 0:
        idt = index_dtype(n)
        if n == 0:
            return jnp.zeros((0,), idt), jnp.zeros((0,), x.dtype)
        # lax.top_k breaks ties by the lower index.
        _, pos = lax.top_k(_keys(words), k)
        pos = jnp.sort(pos)
        return pos.astype(idt), _as_float(words[pos], x.dtype)
    nb = -(-n // bucket)
    idt = index_dtype(bucket)
    if n == 0:
        return jnp.zeros((0,), idt), jnp.zeros((0,), x.dtype)
    pad = nb * bucket - n
    # Padding keys rank below every real key (>= 0); among themselves the
    # lower index wins, which gives the padding entries local indices L .. k-1.
    kb = jnp.pad(_keys(words), (0, pad), constant_values=-1).reshape(nb, bucket)
    _, pos = lax.top_k(kb, k)
    pos = jnp.sort(pos, axis=1)
    g = (
        jnp.arange(nb, dtype=jnp.uint32)[:, None] * np.uint32(bucket) + pos.astype(jnp.uint32)
    ).reshape(-1)
    vals = words.at[g].get(mode="fill", fill_value=0)  # padding: index >= n, value 0
    return pos.reshape(-1).astype(idt), _as_float(vals, x.dtype)


def _as_float(words: jax.Array, dtype) -> jax.Array:
    # The barrier keeps the bitcast out of the fusion that produced the words:
    # XLA's CPU backend was seen to flush 16-bit subnormals when a gather or
    # select on the words is fused with the bitcast to bfloat16.
    return lax.bitcast_convert_type(lax.optimization_barrier(words), dtype)


def decode_ref(indices: jax.Array, values: jax.Array, *, n: int, k: int, bucket: int):
    wt = _word(values.dtype)
    words = lax.bitcast_convert_type(values, wt)
    if bucket == 0:
        out = jnp.zeros((n,), wt).at[indices.astype(jnp.uint32)].set(words, mode="drop")
        return _as_float(out, values.dtype)
    nb = -(-n // bucket)
    rows = jnp.repeat(jnp.arange(nb, dtype=jnp.int32), k)
    dense = jnp.zeros((nb, bucket), wt).at[rows, indices.astype(jnp.int32)].set(words, mode="drop")
    return _as_float(dense.reshape(-1)[:n], values.dtype)


def encode(x: jax.Array, *, k: int, bucket: int, backend: str = "auto"):
    """Flat x (f32/bf16/f16) -> (indices, values): the ``k`` largest ``|x|`` of
    the tensor (``bucket == 0``) or of every bucket, by ascending index.

    Args:
      x: the tensor (flattened here).
      k: elements to keep in all (``bucket == 0``, ``1 <= k <= n``; 0 for an
        empty input) or per bucket (``1 <= k <= bucket``).
      bucket: 0, or a power of two in [8, 65536].
      backend: "auto", "ffi" or "xla".
    Returns:
      ``indices`` (uint8/16/32, see :func:`index_dtype`) and ``values`` (x's
      dtype), :func:`num_entries` each.
    """
    x = x.reshape(-1)
    n = x.size
    m = num_entries(n, k, bucket)
    shapes = (
        jax.ShapeDtypeStruct((m,), index_dtype(n if bucket == 0 else bucket)),
        jax.ShapeDtypeStruct((m,), x.dtype),
    )

    def kernel(x):
        return ffi_call("jaxcomp_topk_encode", shapes, x, k=k, bucket_size=bucket)

    def twin(x):
        return encode_ref(x, k=k, bucket=bucket)

    return dispatch(backend, kernel, twin, x)


def decode(indices, values, *, n: int, k: int, bucket: int, backend: str = "auto"):
    """(indices, values) -> flat array of ``n`` elements in values' dtype:
    the values at their indices, zero elsewhere (padding entries dropped)."""
    out = jax.ShapeDtypeStruct((n,), values.dtype)

    def kernel(indices, values):
        return ffi_call("jaxcomp_topk_decode", (out,), indices, values, k=k, bucket_size=bucket)

    def twin(indices, values):
        return (decode_ref(indices, values, n=n, k=k, bucket=bucket),)

    if n == 0:
        return jnp.zeros((0,), values.dtype)
    return dispatch(backend, kernel, twin, indices, values)[0]


# ---------------------------------------------------------------------------
# Sparse pairs, for the sparse collectives.
# ---------------------------------------------------------------------------
def global_indices(indices: jax.Array, *, n: int, k: int, bucket: int) -> jax.Array:
    """Stored indices (any leading axes) -> global flat int32 indices, with
    every padding entry set to exactly ``n`` (requires ``n < 2^31``)."""
    idx = indices.astype(jnp.int32)
    if bucket == 0:
        return idx
    m = indices.shape[-1]
    base = (jnp.arange(m, dtype=jnp.int32) // k) * bucket
    g = base + idx
    return jnp.where(idx < jnp.minimum(bucket, n - base), g, jnp.int32(n))


def sparse_pairs(payload: Any, *, backend: str = "auto") -> tuple[jax.Array, jax.Array]:
    """A TopK payload -> (global flat indices, decoded values).

    The payload's arrays may carry leading batch axes (e.g. after an
    ``all_gather``); the outputs keep them: ``int32[..., m]`` and
    ``float32[..., m]`` with ``m`` the entries per tensor. Indices of one
    tensor are ascending. Padding entries (the last bucket shorter than ``k``
    in ``k_per_bucket`` mode) read index ``n`` and value 0, so they are
    identifiable and harmless to :func:`scatter_add`. With a ``value_codec``
    the values are that codec's decoded values. Requires ``n < 2^31``.

    Args:
      payload: a :class:`~jaxcomp.Payload` of :class:`~jaxcomp.codecs.TopK`.
      backend: for the nested value codec's decode.
    Returns:
      ``(indices, values)``.
    """
    codec = payload.codec
    n = payload.size
    k, bucket = codec.selection(n)
    idx = payload["indices"]
    batch = idx.shape[:-1]
    values = codec.decode_values(payload, batch, backend=backend).astype(jnp.float32)
    g = global_indices(idx, n=n, k=k, bucket=bucket)
    return g, jnp.where(g < n, values, jnp.float32(0))


def scatter_add(indices: jax.Array, values: jax.Array, n: int) -> jax.Array:
    """Sums sparse pairs (any matching leading axes) into a dense float32[n];
    indices outside ``[0, n)`` (padding) are dropped. The order in which
    duplicate indices are added is unspecified (float sums may differ in the
    last bit between orders), and the additions follow the platform's float
    rules (XLA's CPU flushes subnormal values to zero)."""
    return (
        jnp.zeros((n,), jnp.float32)
        .at[indices.reshape(-1)]
        .add(values.reshape(-1).astype(jnp.float32), mode="drop")
    )
