"""3LC encode/decode: FFI targets ``jaxcomp_threelc_encode``/``_decode`` and
their pure-JAX twins (ffi/include/jaxcomp/threelc.h, ternary.h).

Lim, Andersen, Kaminsky, "3LC: Lightweight and Effective Traffic Compression
for Distributed Machine Learning" (SysML 2019):

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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.ops import ternary
from jaxcomp.ops._dispatch import dispatch, ffi_call

ZERO_BYTE = 121  # five zeros, base-3^5
RUN_BASE = 243  # first run byte: a run of 2
MAX_RUN = 14
# CUDA launch geometry shared with cuda/threelc_ops.cu: stream bytes per block
# of the scan kernels, which decides the size of the work buffer.
BLOCK_BYTES = 4096


def sparsity_bits(s: float) -> int:
    """The float32 bits of the sparsity multiplier, the kernels' attribute."""
    return int(np.array(s, np.float32).view(np.uint32))


def work_nbytes(n: int, capacity: int) -> int:
    """Scratch bytes of the kernels: the base-3^5 bytes (rounded up to 8), 8
    int32 control words and two int64 counters per block of BLOCK_BYTES for
    the CUDA scans (cuda/threelc_ops.cu; the CPU kernels use the first part)."""
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


def encode_ref(x: jax.Array, *, s: float, capacity: int):
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


def decode_ref(stream, scale, length, overflow, *, n: int, dtype):
    nb = ternary.num_bytes(n)
    b, ok = unzre_ref(stream, length, overflow, nb)
    if n == 0:
        return jnp.zeros((0,), dtype)
    q = ternary.unpack(b, n).astype(jnp.int32) - 1
    m = jnp.where(ok, scale.reshape(()), np.float32(np.nan))
    return (q.astype(jnp.float32) * m).astype(dtype)


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------
def _enc_shapes(n: int, capacity: int):
    return (
        jax.ShapeDtypeStruct((capacity,), jnp.uint8),
        jax.ShapeDtypeStruct((1,), jnp.float32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.uint8),
        jax.ShapeDtypeStruct((work_nbytes(n, capacity),), jnp.uint8),
    )


def encode(x, *, s: float, capacity: int, backend: str = "auto"):
    """Flat x (f32/bf16/f16) -> (stream uint8[capacity], scale float32[1],
    length int32[1], overflow uint8[1])."""
    x = x.reshape(-1)

    def kernel(x):
        outs = ffi_call(
            "jaxcomp_threelc_encode",
            _enc_shapes(x.size, capacity),
            x,
            sparsity_bits=sparsity_bits(s),
        )
        return outs[:4]

    def twin(x):
        return encode_ref(x, s=s, capacity=capacity)

    return dispatch(backend, kernel, twin, x)


def decode(stream, scale, length, overflow, *, n: int, dtype, backend: str = "auto"):
    """(stream, scale, length, overflow) -> flat array of n elements in dtype."""
    out = jax.ShapeDtypeStruct((n,), jnp.dtype(dtype))
    work = jax.ShapeDtypeStruct((work_nbytes(n, stream.shape[0]),), jnp.uint8)

    def kernel(stream, scale, length, overflow):
        return ffi_call("jaxcomp_threelc_decode", (out, work), stream, scale, length, overflow)[:1]

    def twin(stream, scale, length, overflow):
        return (decode_ref(stream, scale, length, overflow, n=n, dtype=dtype),)

    return dispatch(backend, kernel, twin, stream, scale, length, overflow)[0]
