"""Decoding received and own payloads to float32, as the collectives do it.

Payloads travel as :class:`~jaxcomp.Payload` objects whose arrays may carry
leading axes (one per stacked tensor); the metadata describes one tensor.
Everything here reads the codec protocol (:mod:`jaxcomp.codecs.base`), never
a particular codec; which implementation runs is decided in
:mod:`jaxcomp.ops._dispatch`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp._ffi import Backend, cpu_available, cuda_available, resolve_backend
from jaxcomp.codecs.base import Codec
from jaxcomp.ops import platform_dependent
from jaxcomp.payload import Payload


def fused_backend(codec: Codec) -> str:
    """The backend the collectives decode ``codec``'s payloads with:
    "fused" where its decode is element-wise (``Codec.elementwise_decode``),
    "auto" (the kernel) otherwise.

    "fused" is the pure-JAX twin wherever it is faster than writing a
    full-size float32 tensor that is read again (GPUs, and platforms
    without kernels): XLA fuses the decode into what consumes it (a sum
    over the received payloads, the residual update, the split into
    leaves). On the CPU it is the kernel (:func:`jaxcomp.ops._dispatch.
    dispatch` says why). The twin gives the kernel's bits (the contract
    suite checks it); fused, XLA may contract a decoded product and the add
    it feeds into one FMA, so sums and residuals can differ from the
    kernel path's in the last bit, never more (every device runs the same
    program, so the result is still identical on every device)."""
    return "fused" if codec.elementwise_decode else "auto"


def decode_f32(payload: Payload, *, fused: bool = False) -> jax.Array:
    """One tensor's payload decoded, flat, in float32: with ``fused``, by
    :func:`fused_backend`; else by the kernel where there is one."""
    backend = fused_backend(payload.codec) if fused else "auto"
    return payload.codec.decode(payload, backend=backend).reshape(-1).astype(jnp.float32)


def decode_own(payload: Payload) -> jax.Array:
    """A payload this device made, decoded (flat, float32) for what it
    keeps: ``sent``, or a server residual ``target - decoded``. Fused
    (:func:`fused_backend`): on GPUs XLA fuses the decode into the residual
    update, so error feedback costs one pass over the gradient instead of a
    full-size decoded tensor written and read again."""
    return decode_f32(payload, fused=True)


def decode_rows(payload: Payload, *, fused: bool = False) -> jax.Array:
    """Stacked payloads (one leading axis) of ``n`` values each -> float32
    ``[rows, n]``: one decode of the joined payload where the codec splits
    at ``n``, else one batched decode."""
    codec, n = payload.codec, payload.size
    rows = next(iter(payload.arrays.values())).shape[0]
    g = codec.split_granularity()
    if g and n % g == 0:
        joined = payload.map(lambda a: a.reshape(rows * a.shape[1], *a.shape[2:]))
        joined = Payload(codec, (rows * n,), payload.dtype, joined.arrays)
        return decode_f32(joined, fused=fused).reshape(rows, n)
    return jax.vmap(lambda p: decode_f32(p, fused=fused))(payload)


def decode_sum(payload: Payload) -> jax.Array:
    """Stacked payloads (one leading axis) decoded and summed in row order
    (float32), writing only the sum, not a float32 row per device: through
    the codec's decode-and-accumulate kernel where it has one for the
    platform (``Codec.decode_sum_kernel`` on the CPU,
    ``Codec.cuda_decode_sum_kernel`` on CUDA) and kernels run here, else
    fused (on GPUs, an element-wise twin decode fused into the sum, one
    pass)."""
    codec = payload.codec

    def fused_rows(p=payload):
        return ordered_sum(decode_rows(p, fused=True))

    if not (codec.decode_sum_kernel and payload.dtype == jnp.float32):
        return fused_rows()
    if resolve_backend("auto") is Backend.XLA:
        return fused_rows()

    # The codec's kernel on each platform that has one and the fused rows
    # elsewhere: one primitive with a rule per platform, as compress_kept's.
    # The arrays go as a tuple, in layout order: a dict would be flattened
    # in the order of its sorted keys.
    names = tuple(payload.arrays)

    def rebuilt(arrays):
        return Payload(codec, payload.shape, payload.dtype, dict(zip(names, arrays, strict=True)))

    def kernel(arrays):
        return codec.decode_sum(rebuilt(arrays), backend="auto")

    def rows(arrays):
        return fused_rows(rebuilt(arrays))

    return platform_dependent(
        tuple(payload.arrays.values()),
        cpu=kernel if cpu_available() else rows,
        cuda=kernel if codec.cuda_decode_sum_kernel and cuda_available() else rows,
        default=rows,
    )


def ordered_sum(rows: jax.Array) -> jax.Array:
    """Sum over the leading axis, left to right: the same order everywhere."""
    total = rows[0]
    for i in range(1, rows.shape[0]):
        total = total + rows[i]
    return total
