"""3LC: 3-value quantization with sparsity multiplication, base-3^5 encoding
and zero-run encoding.

Lim, Andersen, Kaminsky, "3LC: Lightweight and Effective Traffic Compression
for Distributed Machine Learning" (SysML 2019), sections 3.1-3.3. The paper
pairs it with error accumulation buffers (section 3.1), which
``jaxcomp.optax.compress_gradients`` provides.
Kernels: ffi/include/jaxcomp/threelc.h (bodies), ffi/threelc.cc, cuda/threelc.cu.

- section 3.1, 3-value quantization with sparsity multiplication: one scale
  ``m = max|x| * s`` for the whole tensor (float32 product), and
  ``q = round(x / m)`` with round-half-to-even, which for ``|x / m| <= 1`` is
  ``q = sign(x)`` when ``2|x| > m`` and ``q = 0`` otherwise (``2|x|`` is
  exact, so the test needs no division). Value ``m * q``.
- section 3.2, base-3^5 encoding of the digits ``q + 1`` (jaxcomp/ops/ternary.py).
- section 3.3, zero-run encoding: ``k`` consecutive bytes 121 (five zeros),
  ``2 <= k <= 14``, become the byte ``243 + (k - 2)``, greedily from the start
  of each run (a run of 30 is 14, 14, 2; a run of 15 is 14 and a lone 121).

The stream lives in a fixed-capacity uint8 buffer; ``length`` is the length of
the complete stream (it may exceed the capacity: then ``overflow`` is 1 and the
buffer holds the stream's first ``capacity`` bytes). Bytes past the length are
zero.

Corrupted streams: the CPU kernel raises; the twin, which cannot raise under
jit, decodes the whole tensor to NaN, as the CUDA kernel does. A stream is
corrupted when ``length`` is negative, ``overflow`` is not ``length >
capacity`` (0 or 1), the runs do not expand to exactly ``ceil(n / 5)`` bytes,
or it is not the greedy (canonical) encoding: a 121 or a run byte other than
255 followed by a 121 or a run byte. An overflowed payload decodes to NaN.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Kernels, VariableRateCodec, array, check_int, register
from jaxcomp.ops import ieee, ternary
from jaxcomp.payload import Payload

# Bytes of a payload besides the stream: the float32 scale, the int32 length
# and the uint8 overflow flag.
_FIXED_NBYTES = 4 + 4 + 1
# Capacity tiers, as divisors of the no-ZRE size: zero-run encoding shrinks a
# stream at most 14-fold (14 bytes of 121 become one), so no tier below 1/14
# could ever be taken; between 1/14 and the full size the steps waste at most
# about 40% of a tier.
TIER_DIVISORS = (14, 10, 7, 5, 4, 3, 2, 1)


def _check_sparsity(s: Any) -> float:
    ok = isinstance(s, (int, float, np.integer, np.floating)) and not isinstance(s, bool)
    # float32(s) is what the kernels multiply by; it must stay below 2 too.
    ok = ok and 1.0 <= float(s) < 2.0 and float(np.float32(s)) < 2.0
    if not ok:
        raise ValueError(f"ThreeLC: sparsity must be a number in [1.0, 2.0), got {s!r}")
    return float(s)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class ThreeLC(VariableRateCodec):
    """3LC (Lim et al., SysML 2019, section 3): deterministic, one scale for
    the whole tensor.

    ``m = max|x| * float32(sparsity)`` and each value becomes ``m * q`` with
    ``q = round(x / m)`` in {-1, 0, 1}, rounding half to even (section 3.1).
    The digits ``q + 1`` are base-3^5 packed (section 3.2) and runs of five
    zeros are zero-run encoded (section 3.3), so the size follows the data:
    the payload is a fixed-capacity buffer plus the used length
    (``payload.used_nbytes``); one that overflows its capacity decodes to
    NaN everywhere. docs/codecs.md has the payload and the encoding.

    Args:
      sparsity: the sparsity multiplier ``s``, in [1.0, 2.0); larger values
        give more zeros and a shorter stream.
      capacity: bytes of the stream buffer, an int >= 0, or None (default) for
        ``ceil(n / 5)``, the size without zero-run encoding, which the stream
        never exceeds. A smaller capacity saves wire bytes when the data is
        sparse enough and reports an overflow otherwise.

    References:
      Lim, Andersen, Kaminsky, "3LC: Lightweight and Effective Traffic
      Compression for Distributed Machine Learning" (SysML 2019), sections
      3.1-3.3.
    """

    sparsity: float = 1.0
    capacity: int | None = None

    name: ClassVar[str] = "threelc"
    codec_id: ClassVar[int] = 7
    elementwise_decode: ClassVar[bool] = False  # zero-run decoding is a scan
    # The kernels of ffi/threelc.cc and cuda/threelc.cu: "auto" runs the CUDA
    # encode and decode, faster than the twins (docs/gpu.md).
    kernels: ClassVar[Kernels] = Kernels.of(cpu=("encode", "decode", "encode_feedback"))

    @property
    def recompression(self) -> str:  # type: ignore[override]
        """Codec.recompression: with s = 1.0 the two-phase all-reduce trains
        as allgather does; above it the owner's second rounding drops too
        much of the reduced chunk (docs/accuracy.md)."""
        return "coarse" if self.sparsity > 1.0 else "fine"

    def __post_init__(self):
        object.__setattr__(self, "sparsity", _check_sparsity(self.sparsity))
        if self.capacity is not None:
            check_int(
                "ThreeLC",
                "capacity",
                self.capacity,
                "None or an int in [0, 2^31 - 1]",
                isinstance(self.capacity, (int, np.integer)) and 0 <= self.capacity < 2**31,
            )
            object.__setattr__(self, "capacity", int(self.capacity))

    @classmethod
    def examples(cls, *, coverage=False):
        users = (cls(), cls(sparsity=1.5))
        # Overflows on most inputs of more than a few hundred elements.
        more = (cls(sparsity=1.9, capacity=48),)
        return users + more if coverage else users

    # -- layout and wire -------------------------------------------------
    def stream_capacity(self, n: int) -> int:
        """Bytes of the stream buffer for n elements."""
        return ternary.num_bytes(n) if self.capacity is None else self.capacity

    def arrays(self, n, dtype):
        return {
            "stream": array(self.stream_capacity(n), np.uint8),
            "scale": array(1, np.float32),
            "length": array(1, np.int32),
            "overflow": array(1, np.uint8),
        }

    def wire_params(self) -> tuple[int, ...]:
        # The multiplier as the bits of its float64 value; capacity -1 for None.
        (bits,) = struct.unpack("<q", struct.pack("<d", self.sparsity))
        return (bits, -1 if self.capacity is None else self.capacity)

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> ThreeLC:
        bits, capacity = params
        (s,) = struct.unpack("<d", struct.pack("<q", bits))
        return cls(sparsity=s, capacity=None if capacity == -1 else capacity)

    # -- encode / decode -------------------------------------------------
    def _encode(self, flat, key, backend):
        n = flat.size
        cap = self.stream_capacity(n)
        backend, cuda = self.route("encode", backend)
        return self.kernel(
            backend,
            "jaxcomp_threelc_encode",
            lambda x: encode_ref(x, self.sparsity, cap),
            (flat,),
            self.arrays(n, flat.dtype).values(),
            scratch=(array(work_nbytes(n, cap), np.uint8),),
            sparsity_bits=sparsity_bits(self.sparsity),
            cuda=cuda,
        )

    def _decode(self, payload, backend):
        n = payload.size
        backend, cuda = self.route("decode", backend)
        return self.kernel(
            backend,
            "jaxcomp_threelc_decode",
            lambda *a: (decode_ref(*a, n, payload.dtype),),
            tuple(payload.arrays.values()),
            (self.output(payload),),
            scratch=(array(work_nbytes(n, payload["stream"].shape[0]), np.uint8),),
            cuda=cuda,
        )[0]

    def _feedback_fused(self, flat, res, key, backend, shape, cuda=False):
        # The one-pass kernel (ffi/threelc.cc): the scale of acc = f32(x) +
        # residual, then its digits and new residual in one pass, then the
        # zero-run encoding; the twin is the three calls.
        n = flat.size
        if n == 0:
            return self._feedback_by_calls(flat, res, key, backend, shape)
        cap = self.stream_capacity(n)
        layout = self.arrays(n, jnp.float32)

        def twin(flat, res):
            acc = flat.astype(jnp.float32) + res
            arrays = encode_ref(acc, self.sparsity, cap)
            return (*arrays, acc - decode_ref(*arrays, n, jnp.float32))

        outs = self.kernel(
            backend,
            "jaxcomp_threelc_encode_feedback",
            twin,
            (flat, res),
            (*layout.values(), jax.ShapeDtypeStruct((n,), jnp.float32)),
            scratch=(array(work_nbytes(n, cap), np.uint8),),
            cuda=cuda,
            sparsity_bits=sparsity_bits(self.sparsity),
        )
        return self.payload(tuple(outs[:-1]), shape, jnp.float32), outs[-1].reshape(shape)

    # -- variable rate (VariableRateCodec) ---------------------------------
    def capacity_tiers(self, n: int) -> tuple[int, ...]:
        full = self.stream_capacity(n)
        return tuple(sorted({-(-full // d) for d in TIER_DIVISORS}))

    def used_nbytes(self, payload: Payload) -> jax.Array:
        """Stream bytes in use (at most the capacity), plus the scale, the
        length and the flag: what has to cross the wire."""
        cap = payload["stream"].shape[-1]
        used = jnp.clip(payload["length"][..., 0], 0, cap)
        return (used + _FIXED_NBYTES).astype(jnp.int32)

    @staticmethod
    def overflowed(payload: Payload) -> jax.Array:
        """True where the stream did not fit its buffer (bool; one per tensor)."""
        return payload["overflow"][..., 0] != 0

    @staticmethod
    def stream_length(payload: Payload) -> jax.Array:
        """Bytes of the complete stream (int32): the smallest capacity that
        holds it, which a caller may use to choose a capacity."""
        return payload["length"][..., 0]

    def with_capacity(self, payload: Payload, nbytes: int) -> Payload:
        """The payload with its stream buffer cut or zero-padded to ``nbytes``.

        Returns a payload of ``ThreeLC(sparsity=self.sparsity,
        capacity=nbytes)``. Nothing is lost when ``nbytes`` is at least the
        stream length; otherwise the result is marked overflowed. Works on
        traced arrays and payloads with leading batch axes (``nbytes`` is
        static).
        """
        if payload.codec != self:
            raise ValueError(f"{self!r}.with_capacity got a payload of {payload.codec!r}")
        codec = dataclasses.replace(self, capacity=nbytes)
        stream = payload["stream"]
        cap = stream.shape[-1]
        if nbytes <= cap:
            stream = stream[..., :nbytes]
        else:
            pad = [(0, 0)] * (stream.ndim - 1) + [(0, nbytes - cap)]
            stream = jnp.pad(stream, pad)
        length = payload["length"]
        overflow = ((payload["overflow"] != 0) | (length > nbytes)).astype(jnp.uint8)
        return codec.payload(
            (stream, payload["scale"], length, overflow), payload.shape, payload.dtype
        )


# ---------------------------------------------------------------------------
# Pure-JAX twins (threelc.h, ternary.h)
# ---------------------------------------------------------------------------
ZERO_BYTE = 121  # five zeros, base-3^5
RUN_BASE = 243  # first run byte: a run of 2
MAX_RUN = 14
# CUDA launch geometry shared with cuda/threelc.cu: stream bytes per block
# of the scan kernels, which decides the size of the work buffer.
BLOCK_BYTES = 4096


def sparsity_bits(s: float) -> int:
    """The float32 bits of the sparsity multiplier, the kernels' attribute."""
    return int(np.array(s, np.float32).view(np.uint32))


def work_nbytes(n: int, capacity: int) -> int:
    """Scratch bytes of the kernels: the base-3^5 bytes (rounded up to 8), 8
    int32 control words and two int64 counters per block of BLOCK_BYTES for
    the CUDA scans (cuda/threelc.cu; the CPU kernels use the first part)."""
    m = ternary.num_bytes(n)
    blocks = -(-max(m, capacity) // BLOCK_BYTES)
    return -(-m // 8) * 8 + 32 + 16 * blocks


# ---------------------------------------------------------------------------
# Twin: quantization and base-3^5 packing
# ---------------------------------------------------------------------------
def scale_ref(x: jax.Array, s: float) -> jax.Array:
    """m = max|x| * float32(s), the max over integer abs bits (order-free,
    NaN wins)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & np.uint32(0x7FFFFFFF)
    mx = jnp.max(bits, initial=np.uint32(0))
    return lax.bitcast_convert_type(mx, jnp.float32) * np.float32(s)


def digits_ref(x: jax.Array, m: jax.Array) -> jax.Array:
    """q + 1 in {0, 1, 2} (uint32) of each element of flat x."""
    xf = x.astype(jnp.float32)
    big = (jnp.abs(xf) * np.float32(2.0) > m).astype(jnp.uint32)
    neg = lax.bitcast_convert_type(xf, jnp.uint32) >> 31
    return np.uint32(1) + big - np.uint32(2) * (big & neg)


def zre_ref(b: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Zero-run encoding of base-3^5 bytes ``b`` -> (uint8[capacity] buffer,
    int32 length of the complete stream)."""
    m = b.size
    if m == 0:
        return jnp.zeros((capacity,), jnp.uint8), jnp.zeros((), jnp.int32)
    idx = jnp.arange(m, dtype=jnp.int32)
    z = b == ZERO_BYTE
    prev_z = jnp.concatenate([jnp.zeros((1,), bool), z[:-1]])
    # Position inside the run of 121s: distance to the run's first byte.
    start = lax.cummax(jnp.where(z & ~prev_z, idx, 0))
    pos = idx - start
    # Length of the chunk a chunk head opens: 121s from here, at most 14
    # (a bounded look-ahead, as the kernels do it).
    zi = z.astype(jnp.int32)
    zpad = jnp.concatenate([zi, jnp.zeros((MAX_RUN,), jnp.int32)])
    run = zi
    alive = zi
    for d in range(1, MAX_RUN):
        alive = alive * zpad[d : d + m]
        run = run + alive
    head = z & (pos % MAX_RUN == 0)
    emit = ~z | head
    value = jnp.where(
        z, jnp.where(run == 1, ZERO_BYTE, RUN_BASE - 2 + run), b.astype(jnp.int32)
    ).astype(jnp.uint8)
    cnt = emit.astype(jnp.int32)
    offs = jnp.cumsum(cnt) - cnt
    length = jnp.sum(cnt)
    where = jnp.where(emit, offs, capacity)  # non-emitting bytes: out of range, dropped
    buf = jnp.zeros((capacity,), jnp.uint8).at[where].set(value, mode="drop")
    return buf, length


def encode_ref(x: jax.Array, s: float, capacity: int):
    n = x.size
    m = scale_ref(x, s)
    b = ternary.pack(digits_ref(x, m)) if n else jnp.zeros((0,), jnp.uint8)
    buf, length = zre_ref(b, capacity)
    overflow = (length > capacity).astype(jnp.uint8)
    return buf, m.reshape(1), length.reshape(1), overflow.reshape(1)


# ---------------------------------------------------------------------------
# Twin: decode
# ---------------------------------------------------------------------------
def unzre_ref(
    stream: jax.Array, length: jax.Array, overflow: jax.Array, nbytes: int
) -> tuple[jax.Array, jax.Array]:
    """Expands a zero-run-encoded stream into ``nbytes`` base-3^5 bytes ->
    (bytes, ok): ok is False for an overflowed or corrupted stream."""
    cap = stream.size
    length = length.reshape(()).astype(jnp.int32)
    overflow = overflow.reshape(()).astype(jnp.int32)
    ok = (length >= 0) & (length <= cap) & (overflow == 0)
    if cap == 0:
        return jnp.full((nbytes,), ZERO_BYTE, jnp.uint8), ok & (nbytes == 0)
    s = stream.astype(jnp.int32)
    idx = jnp.arange(cap, dtype=jnp.int32)
    valid = idx < length
    is_run = s >= RUN_BASE
    cnt = jnp.where(valid, jnp.where(is_run, s - (RUN_BASE - 2), 1), 0)
    ends = jnp.cumsum(cnt)
    ok = ok & (ends[-1] == nbytes)
    # Canonical: a 121 or a run byte < 255 never precedes a 121 or run byte.
    zeroish = (s == ZERO_BYTE) | is_run
    continues = (s == ZERO_BYTE) | (is_run & (s != 255))
    bad_pair = continues[:-1] & zeroish[1:] & valid[1:]
    ok = ok & ~jnp.any(bad_pair)
    if nbytes == 0:
        return jnp.zeros((0,), jnp.uint8), ok
    starts = jnp.where(valid, ends - cnt, nbytes)  # out of range: dropped
    marks = jnp.zeros((nbytes,), jnp.int32).at[starts].add(1, mode="drop")
    src = jnp.clip(jnp.cumsum(marks) - 1, 0, cap - 1)
    sb = stream[src]
    out = jnp.where(sb >= RUN_BASE, np.uint8(ZERO_BYTE), sb)
    return out, ok


def decode_ref(stream, scale, length, overflow, n: int, dtype):
    nb = ternary.num_bytes(n)
    b, ok = unzre_ref(stream, length, overflow, nb)
    if n == 0:
        return jnp.zeros((0,), dtype)
    q = ternary.unpack(b, n).astype(jnp.int32) - 1
    m = jnp.where(ok, scale.reshape(()), np.float32(np.nan))
    return ieee.canonical_nan((q.astype(jnp.float32) * m).astype(dtype))  # common.h's NaN rule
