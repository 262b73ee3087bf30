"""TopK: keep the largest magnitudes, send (index, value) pairs.

Renggli et al., "SparCML: High-Performance Sparse Communication for Machine
Learning" (SC19): section 2.2 and Algorithm 1 (Top-k SGD: the k largest
components of the gradient, optionally quantized), section 5.1 (sparse
streams of index-value pairs), section 6 (QSGD for the values) and section
8.3 (the CIFAR-10 runs keep k = 8 or 16 of every bucket of 512 consecutive
elements, values quantized to 4 bits). Selection rules in
``jaxcomp/ops/topk.py``.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import Codec, by_id, check_bucket_size, check_int, register
from jaxcomp.ops import topk as ops
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
class TopK(Codec):
    """The ``k`` largest ``|x|`` and their indices; everything else decodes to 0.

    One of ``fraction`` and ``k_per_bucket`` (neither: ``fraction=0.01``):

    - ``fraction``: ``k`` of the whole tensor, ``k = min(n, max(1,
      floor(fraction * n + 0.5)))`` for ``n > 0`` (the nearest integer to
      ``fraction * n``, halves up, computed in float64; at least 1), 0 for an
      empty tensor. Indices are global, stored as uint8 / uint16 / uint32 for
      ``n`` up to 2^8 / 2^16 / 2^32.
    - ``k_per_bucket=(k, bucket)``: ``k`` of every bucket of ``bucket``
      consecutive values, as in SparCML's CNN experiments (section 8.3:
      ``(8, 512)`` and ``(16, 512)``). Indices are bucket-local, uint8 for
      ``bucket <= 256``, else uint16; each bucket has ``k`` entries. The last
      bucket, of length ``L < k``, lists its ``L`` values and then padding
      entries with local indices ``L .. k-1`` (so global index ``>= n``) and
      value 0.

    Ranking is by the absolute value's bits (NaN above Inf above every finite
    value, so NaNs are always kept), ties to the lower index; indices are
    ascending. Without a ``value_codec``, values are sent bit for bit in the
    tensor's dtype and decoding is exact at the kept positions.

    Args:
      fraction: ``0 < fraction <= 1``.
      k_per_bucket: ``(k, bucket)``, ``bucket`` a power of two in [8, 65536],
        ``1 <= k <= bucket``.
      value_codec: an optional fixed-rate codec applied to the kept values
        (e.g. ``QSGD(bits=4)``, as SparCML did); its arrays are stored as
        ``"values.<name>"``. TopK is stochastic when this codec is.
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
            if isinstance(vc, TopK) or type(vc).used_nbytes is not Codec.used_nbytes:
                raise ValueError(
                    f"TopK: value_codec must be a fixed-rate codec (not TopK or a "
                    f"variable-rate codec), got {vc!r}"
                )

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
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

    def layout(self, shape, dtype=jnp.float32):
        n = int(np.prod(shape, dtype=np.int64))
        k, bucket = self.selection(n)
        m = ops.num_entries(n, k, bucket)
        out = {"indices": jax.ShapeDtypeStruct((m,), ops.index_dtype(n if bucket == 0 else bucket))}
        if self.value_codec is None:
            out[_VALUES] = jax.ShapeDtypeStruct((m,), jnp.dtype(dtype))
        else:
            for name, spec in self.value_codec.layout((m,), dtype).items():
                out[_PREFIX + name] = spec
        return out

    def _encode(self, flat, seed, backend):
        k, bucket = self.selection(flat.size)
        indices, values = ops.encode(flat, k=k, bucket=bucket, backend=backend)
        out = {"indices": indices}
        if self.value_codec is None:
            out[_VALUES] = values
        else:
            nested = self.value_codec._encode(values, seed, backend)
            out.update({_PREFIX + name: a for name, a in nested.items()})
        return out

    def decode_values(self, payload: Payload, batch: tuple[int, ...] = (), *, backend="auto"):
        """The payload's values in the tensor's dtype, ``[*batch, m]`` (the
        nested codec decoded where there is one)."""
        if self.value_codec is None:
            return payload[_VALUES]
        vc = self.value_codec
        m = payload["indices"].shape[-1]
        arrays = {
            name[len(_PREFIX) :]: a
            for name, a in payload.arrays.items()
            if name.startswith(_PREFIX)
        }

        def one(arrs):
            return vc.decode(Payload(vc, (m,), payload.dtype, arrs), backend=backend)

        for _ in batch:
            one = jax.vmap(one)
        return one(arrays)

    def _decode(self, payload, n, dtype, backend):
        k, bucket = self.selection(n)
        values = self.decode_values(payload, backend=backend)
        return ops.decode(payload["indices"], values, n=n, k=k, bucket=bucket, backend=backend)

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
