"""TopK: keep the largest magnitudes, send (index, value) pairs.

Renggli et al., "SparCML: High-Performance Sparse Communication for Machine
Learning" (SC19): section 2.2 and Algorithm 1 (Top-k SGD: the k largest
components of the gradient, optionally quantized), section 5.1 (sparse
streams of index-value pairs), section 6 (QSGD for the values) and section
8.3 (the CIFAR-10 runs keep k = 8 or 16 of every bucket of 512 consecutive
elements, values quantized to 4 bits).
Kernels: ffi/include/jaxcomp/topk.h (bodies), ffi/topk.cc, cuda/topk.cu.

Ranking (every backend): an element's key is its absolute value's bits as an
unsigned integer (the storage word with the sign bit cleared). Keys order
magnitudes exactly and put NaN above +-Inf, so NaNs are always kept; among
equal keys the lower index wins. Chosen elements are listed by ascending
index; values are copied bit for bit.

Whole-tensor selection (``fraction``) stores global indices;
``k_per_bucket`` selects ``k`` of every bucket and stores bucket-local
indices, ``k`` entries per bucket; the last bucket, of length ``L < k``, lists
its ``L`` elements and then padding entries with local indices ``L .. k-1``
(global index ``>= n``) and value 0.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import (
    Codec,
    Kernels,
    Rate,
    SparseCodec,
    array,
    by_id,
    check_bucket_size,
    check_int,
    index_dtype,
    register,
)
from jaxcomp.payload import Payload

_VALUES = "values"
_PREFIX = "values."
_NO_VALUE_CODEC = -1
_DEFAULT_FRACTION = 0.01


def _fraction_bits(f: float) -> int:
    """A float64 as the int64 of its IEEE-754 bits (wire params are int64)."""
    return struct.unpack("<q", struct.pack("<d", f))[0]


def _bits_fraction(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class TopK(SparseCodec):
    """The ``k`` largest ``|x|`` and their indices; everything else decodes to 0.

    One of ``fraction`` and ``k_per_bucket`` (neither: ``fraction=0.01``).
    ``fraction``: ``k`` of the whole tensor, the nearest integer to
    ``fraction * n`` (halves up, at least 1), with global indices.
    ``k_per_bucket=(k, bucket)``: ``k`` of every bucket, with bucket-local
    indices; the last bucket is padded with entries of value 0. Ranking is by
    the absolute value's bits (NaNs are always kept), ties to the lower
    index; indices are ascending. Without a ``value_codec`` the kept values
    are sent bit for bit. docs/codecs.md has the payload and the edge cases.

    Args:
      fraction: ``0 < fraction <= 1``.
      k_per_bucket: ``(k, bucket)``, ``bucket`` a power of two in [8, 65536],
        ``1 <= k <= bucket``.
      value_codec: an optional fixed-rate codec applied to the kept values
        (e.g. ``QSGD(bits=4)``, as SparCML did); its arrays are stored as
        ``"values.<name>"``. TopK is stochastic when this codec is.

    References:
      Renggli et al., "SparCML: High-Performance Sparse Communication for
      Machine Learning" (SC19), sections 2.2, 5.1, 6 and 8.3.
    """

    fraction: float | None = None
    k_per_bucket: tuple[int, int] | None = None
    value_codec: Codec | None = None

    name: ClassVar[str] = "topk"
    codec_id: ClassVar[int] = 8

    def __post_init__(self):
        if self.fraction is not None and self.k_per_bucket is not None:
            raise ValueError("TopK: give one of fraction and k_per_bucket, not both")
        if self.fraction is None and self.k_per_bucket is None:
            object.__setattr__(self, "fraction", _DEFAULT_FRACTION)
        if self.fraction is not None:
            f = self.fraction
            ok = isinstance(f, (int, float, np.integer, np.floating)) and not isinstance(f, bool)
            if not ok or not (0.0 < float(f) <= 1.0):
                raise ValueError(f"TopK: fraction must be a number in (0, 1], got {f!r}")
            object.__setattr__(self, "fraction", float(f))
        else:
            kb = self.k_per_bucket
            if not isinstance(kb, (tuple, list)) or len(kb) != 2:
                raise ValueError(f"TopK: k_per_bucket must be a pair (k, bucket), got {kb!r}")
            k, bucket = kb
            check_bucket_size("TopK", bucket)
            check_int(
                "TopK", "k (of k_per_bucket)", k, f"in [1, bucket={bucket}]", 1 <= k <= bucket
            )
            object.__setattr__(self, "k_per_bucket", (int(k), int(bucket)))
        vc = self.value_codec
        if vc is not None:
            if not isinstance(vc, Codec):
                raise ValueError(f"TopK: value_codec must be a jaxcomp codec, got {vc!r}")
            if vc.rate not in (Rate.FIXED, Rate.LINEAR):
                raise ValueError(
                    f"TopK: value_codec must be a fixed-rate codec (not TopK or a "
                    f"variable-rate codec), got {vc!r}"
                )

    @classmethod
    def examples(cls, *, coverage=False):
        from jaxcomp.codecs.qsgd import QSGD

        users = (cls(fraction=0.01), cls(k_per_bucket=(8, 512)))
        more = (
            cls(k_per_bucket=(3, 8)),
            cls(fraction=0.05, value_codec=QSGD(bits=4)),
            cls(k_per_bucket=(16, 512), value_codec=QSGD(bits=4, bucket_size=16)),
        )
        return users + more if coverage else users

    # The kernels of ffi/topk.cc and cuda/topk.cu: "auto" runs the CUDA encode
    # (a radix select) and decode, faster than the twins (docs/gpu.md).
    kernels: ClassVar[Kernels] = Kernels.of(cpu=("encode", "decode", "encode_feedback"))

    @property
    def feedback_kernel(self) -> bool:  # type: ignore[override]
        """Whether :meth:`encode_feedback` has the one-pass CPU kernel:
        without a value codec (the kept values are sent exactly, so the new
        residual is ``acc`` with each chosen element's ``acc - acc``)."""
        return self.value_codec is None

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        """Whether encoding needs a key: when the value codec does."""
        return self.value_codec is not None and bool(self.value_codec.stochastic)

    # -- selection ----------------------------------------------------------
    def selection(self, n: int) -> tuple[int, int]:
        """``(k, bucket)`` for a tensor of ``n`` elements: ``bucket`` 0 means
        ``k`` of the whole tensor, else ``k`` of every bucket."""
        if self.k_per_bucket is not None:
            return self.k_per_bucket
        if n == 0:
            return 0, 0
        return min(n, max(1, math.floor(self.fraction * n + 0.5))), 0

    def split_granularity(self):
        if self.k_per_bucket is None:
            return None
        k, bucket = self.k_per_bucket
        if self.value_codec is None:
            return bucket
        g = self.value_codec.split_granularity()
        return bucket if g and k % g == 0 else None

    def entries(self, n: int) -> int:
        """Entries of the payload of ``n`` values: ``k`` (whole tensor) or
        ``k`` per bucket."""
        k, bucket = self.selection(n)
        return k if bucket == 0 else -(-n // bucket) * k

    def arrays(self, n, dtype):
        _, bucket = self.selection(n)
        m = self.entries(n)
        out = {"indices": array(m, index_dtype(n if bucket == 0 else bucket))}
        if self.value_codec is None:
            out[_VALUES] = array(m, dtype)
        else:
            for name, spec in self.value_codec.arrays(m, dtype).items():
                out[_PREFIX + name] = spec
        return out

    def _encode(self, flat, key, backend):
        n = flat.size
        k, bucket = self.selection(n)
        m = self.entries(n)
        results = (array(m, index_dtype(n if bucket == 0 else bucket)), array(m, flat.dtype))
        routed, cuda = self.route("encode", backend)
        indices, values = self.kernel(
            routed,
            "jaxcomp_topk_encode",
            lambda x: encode_ref(x, k, bucket),
            (flat,),
            results,
            k=k,
            bucket_size=bucket,
            cuda=cuda,
        )
        if self.value_codec is None:
            return indices, values
        nested = self.value_codec.encode(values, key, backend=backend)
        return (indices, *nested.arrays.values())

    def _feedback_fused(self, flat, res, key, backend, shape, cuda=False):
        n = flat.size
        if n == 0:
            return self._feedback_by_calls(flat, res, key, backend, shape)
        k, bucket = self.selection(n)
        layout = self.arrays(n, jnp.float32)

        def twin(flat, res):
            acc = flat.astype(jnp.float32) + res
            indices, values = encode_ref(acc, k, bucket)
            return indices, values, acc - decode_ref(indices, values, n, k, bucket)

        outs = self.kernel(
            backend,
            "jaxcomp_topk_encode_feedback",
            twin,
            (flat, res),
            (*layout.values(), jax.ShapeDtypeStruct((n,), jnp.float32)),
            cuda=cuda,
            k=k,
            bucket_size=bucket,
        )
        return self.payload(tuple(outs[:-1]), shape, jnp.float32), outs[-1].reshape(shape)

    def values(self, payload: Payload, *, backend: str = "auto") -> jax.Array:
        """The payload's values in the tensor's dtype, ``[..., entries]``
        (the nested codec decoded where there is one; leading axes kept)."""
        if self.value_codec is None:
            return payload[_VALUES]
        vc = self.value_codec
        m = payload["indices"].shape[-1]
        nested = [a for name, a in payload.arrays.items() if name.startswith(_PREFIX)]

        def one(*arrs):
            return vc.decode(vc.payload(arrs, (m,), payload.dtype), backend=backend)

        for _ in range(payload["indices"].ndim - 1):
            one = jax.vmap(one)
        return one(*nested)

    def _decode(self, payload, backend):
        n = payload.size
        k, bucket = self.selection(n)
        values = self.values(payload, backend=backend)
        if n == 0:
            return jnp.zeros((0,), payload.dtype)
        backend, cuda = self.route("decode", backend)
        return self.kernel(
            backend,
            "jaxcomp_topk_decode",
            lambda i, v: (decode_ref(i, v, n, k, bucket),),
            (payload["indices"], values),
            (self.output(payload),),
            k=k,
            bucket_size=bucket,
            cuda=cuda,
        )[0]

    def pairs(self, payload: Payload, *, backend: str = "auto") -> tuple[jax.Array, jax.Array]:
        """``(indices, values)``: global flat int32 indices (padding entries
        read exactly ``n``) and the decoded values in float32 (0 at padding),
        ``[..., entries]`` with the payload's leading axes kept. Indices of
        one tensor are ascending. Requires ``n < 2^31``."""
        n = payload.size
        k, bucket = self.selection(n)
        g = global_indices(payload["indices"], n, k, bucket)
        values = self.values(payload, backend=backend).astype(jnp.float32)
        return g, jnp.where(g < n, values, jnp.float32(0))

    # -- wire ---------------------------------------------------------------
    def wire_params(self):
        """``(mode, a, b, value codec id, *value codec params)``: mode 0 is
        ``fraction`` (``a`` = the float64 bits of fraction as int64, ``b`` =
        0), mode 1 is ``k_per_bucket`` (``a = k``, ``b = bucket``); value codec
        id -1 means none (and nothing follows)."""
        if self.fraction is not None:
            head = (0, _fraction_bits(self.fraction), 0)
        else:
            head = (1, *self.k_per_bucket)
        if self.value_codec is None:
            return (*head, _NO_VALUE_CODEC)
        vc = self.value_codec
        return (*head, vc.codec_id, *(int(p) for p in vc.wire_params()))

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Any:
        if len(params) < 4:
            raise ValueError(f"TopK: expected at least 4 wire params, got {len(params)}")
        mode, a, b, vid, *rest = params
        vc = None
        if vid != _NO_VALUE_CODEC:
            vcls = by_id(vid)
            if vcls is None:
                raise ValueError(f"TopK: unknown value codec id {vid}")
            vc = vcls.from_wire_params(tuple(rest))
        elif rest:
            raise ValueError("TopK: params follow a value codec id of -1 (none)")
        if mode == 0:
            if b != 0:
                raise ValueError(f"TopK: fraction mode needs param 2 = 0, got {b}")
            return cls(fraction=_bits_fraction(a), value_codec=vc)
        if mode == 1:
            return cls(k_per_bucket=(a, b), value_codec=vc)
        raise ValueError(f"TopK: mode must be 0 (fraction) or 1 (k_per_bucket), got {mode}")


# ---------------------------------------------------------------------------
# Pure-JAX twins (topk.h)
# ---------------------------------------------------------------------------
def _word(dtype) -> np.dtype:
    return np.dtype(np.uint32) if np.dtype(dtype).itemsize == 4 else np.dtype(np.uint16)


def _keys(words: jax.Array) -> jax.Array:
    """topk.h: topk_key, as int32 (keys fit in 31 bits)."""
    mask = 0x7FFFFFFF if words.dtype == jnp.uint32 else 0x7FFF
    return (words & np.array(mask, words.dtype)).astype(jnp.int32)


def encode_ref(x: jax.Array, k: int, bucket: int):
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


_NAN_WORDS = {np.dtype(jnp.float32): 0x7FC00000, np.dtype(jnp.bfloat16): 0x7FC0}
_NAN_WORDS[np.dtype(jnp.float16)] = 0x7E00


def well_formed(indices: jax.Array, n: int, k: int, bucket: int) -> jax.Array:
    """topk.h: topk_entry_ok over every entry, as one bool: each stored
    index below its range's limit (n, or the bucket size) and above the
    entry before it in its range (the whole tensor, or its bucket)."""
    idx = indices.astype(jnp.uint32)
    if bucket == 0:
        rows, limit = idx.reshape(1, -1), n
    else:
        rows, limit = idx.reshape(-1, k), bucket
    ok = jnp.all(rows < np.uint32(limit))
    return ok & jnp.all(rows[:, 1:] > rows[:, :-1])


def decode_ref(indices: jax.Array, values: jax.Array, n: int, k: int, bucket: int):
    wt = _word(values.dtype)
    words = lax.bitcast_convert_type(values, wt)
    if bucket == 0:
        out = jnp.zeros((n,), wt).at[indices.astype(jnp.uint32)].set(words, mode="drop")
    else:
        nb = -(-n // bucket)
        rows = jnp.repeat(jnp.arange(nb, dtype=jnp.int32), k)
        dense = (
            jnp.zeros((nb, bucket), wt).at[rows, indices.astype(jnp.int32)].set(words, mode="drop")
        )
        out = dense.reshape(-1)[:n]
    # A malformed payload decodes to NaN everywhere (topk.h, topk_entry_ok).
    nan = np.array(_NAN_WORDS[np.dtype(values.dtype)], wt)
    out = jnp.where(well_formed(indices, n, k, bucket), out, nan)
    return _as_float(out, values.dtype)


def global_indices(indices: jax.Array, n: int, k: int, bucket: int) -> jax.Array:
    """Stored indices (any leading axes) -> global flat int32 indices, with
    every padding entry set to exactly ``n`` (requires ``n < 2^31``)."""
    idx = indices.astype(jnp.int32)
    if bucket == 0:
        return idx
    m = indices.shape[-1]
    base = (jnp.arange(m, dtype=jnp.int32) // k) * bucket
    g = base + idx
    return jnp.where(idx < jnp.minimum(bucket, n - base), g, jnp.int32(n))
