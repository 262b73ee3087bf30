"""Error feedback: its arithmetic, here and nowhere else.

A worker residual ``r`` enters a compression as ``acc = x + r``
(:func:`accumulate`) and leaves as what the compression did not get
across, ``acc - sent`` (:func:`kept`): Seide et al.'s 1-bit SGD, 3LC's
accumulation buffers, SparCML's residual. :func:`compress_kept` is that
step around one compression (by a codec's one-pass kernel where it has
one), :func:`owner_stage` the same for an owner's server residual of a
reduced chunk (two-level error feedback), :func:`charge` the one-level
alternative, and :func:`all_finite` the flag of the non-finite rule (a step
whose mean is not finite keeps every residual as it was). The optax
transformations, the collectives, the sharded step and PowerSGD call these.

Where a codec has a one-pass kernel (``Codec.feedback_kernel``) those
compressions run it on the CPU: the payload and the new residual come out
of one pass over the input and the residual, with no sum and no decoded
tensor written out; on GPUs where the codec's rule says so
(``Codec.cuda_auto`` lists "encode_feedback"). Elsewhere (other GPUs'
codecs, codecs without one, inputs that are not float32) they are the
separate calls: the sum, the encode ("auto": the CUDA kernel where
``cuda_auto`` lists "encode", else the twin) and the fused decode
(:func:`decode_own`), which XLA fuses into the subtraction.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.codecs.base import Codec
from jaxcomp.collectives._decode import decode_own
from jaxcomp.ops import platform_dependent
from jaxcomp.payload import Payload


def accumulate(x: jax.Array, residual: jax.Array) -> jax.Array:
    """``acc = float32(x) + residual``: what error feedback compresses (in
    the residual's dtype: float32, or float64 for float64 leaves)."""
    return x.astype(residual.dtype) + residual


def kept(acc: jax.Array, sent: jax.Array) -> jax.Array:
    """The new residual: what ``acc`` did not get across, ``acc - sent``
    (``sent`` what the compression made of it), in ``acc``'s dtype."""
    return acc - sent.astype(acc.dtype)


def one_pass(codec: Codec, dtype) -> bool:
    """Whether :func:`compress_kept` runs ``codec``'s one-pass kernel (on
    the CPU) for an input of ``dtype``: codecs with one, float32 inputs
    (the rule of ``Codec.encode_feedback`` compresses the float32 sum, which
    is what a float32 input's separate calls compress too)."""
    return bool(codec.feedback_kernel) and jnp.dtype(dtype) == jnp.float32


def compress_kept(
    codec: Codec, x: jax.Array, residual: jax.Array, key, dtype
) -> tuple[Payload, jax.Array]:
    """The payload of ``x + residual`` and what it misses: ``(payload, x +
    residual - decoded)``, float32 and flat.

    ``x`` is flat, in ``dtype`` or float32; ``residual`` a float32 residual of
    its length; the float32 sum is compressed in ``dtype`` (the tensor's).
    With :func:`one_pass`, ``Codec.encode_feedback`` on the CPU, on GPUs
    where ``Codec.cuda_auto`` lists "encode_feedback", and the separate
    calls elsewhere (one primitive lowered per platform,
    ``jaxcomp.ops._dispatch.platform_dependent``). The one-pass kernels
    give the separate kernels' bits (tests/test_feedback.py,
    tests/test_gpu.py); the separate calls' fused decode may differ in a
    residual's last bit where XLA contracts it into the subtraction
    (:func:`jaxcomp.collectives._decode.fused_backend`).
    """

    def calls(x, residual, *key):
        acc = accumulate(x, residual)
        p = codec.encode(acc.astype(dtype), *key)
        return p, kept(acc, decode_own(p))

    if not one_pass(codec, dtype):
        return calls(x, residual, key)

    def fused(x, residual, *key):
        return codec.encode_feedback(x, residual, *key)

    # The key is an operand: each branch is traced where it is lowered.
    keys = () if key is None else (key,)
    on_cuda = fused if codec.route("encode_feedback", "auto")[1] else calls
    return platform_dependent(x, residual, *keys, cpu=fused, cuda=on_cuda, default=calls)


def owner_stage(
    codec: Codec, reduced: jax.Array, div: int, state, key, dtype, *, decoded: bool = False
):
    """The last compression of a reduced chunk, by the device that owns it.

    With a server residual ``state`` (float32, the chunk's length, in units
    of the result: of the mean for ``pmean``), the owner compresses
    ``reduced / div + state`` and keeps what that compression missed as the
    new state: two-level error feedback, each residual at the scale of what
    it compresses (DeepSpeed's compressed all-reduce for 1-bit Adam keeps a
    worker and a server error the same way); by :func:`compress_kept`, in
    one pass where the codec has the kernel, unless the caller needs the
    decoded chunk (``decoded``). Without one (``state`` None) the error is
    returned in units of the sum, for the caller to charge to the owner's
    ``sent`` (:func:`charge`: one-level error feedback).

    Returns:
      ``(payload, decoded float32 or None, new_state, error)``: the decoded
      chunk only where ``decoded`` or without a state; ``new_state`` None
      without a state, ``error`` None with one.
    """
    target = reduced if div == 1 else reduced / div
    if state is not None and not decoded:
        payload, new_state = compress_kept(codec, target, state, key, dtype)
        return payload, None, new_state, None
    if state is not None:
        target = target + state
    payload = codec.encode(target.astype(dtype), key)
    hat = decode_own(payload)
    if state is not None:
        return payload, hat, kept(target, hat), None
    error = hat - reduced if div == 1 else hat * div - reduced
    return payload, hat, None, error


def charge(own: jax.Array, owner: jax.Array, c: int, error: jax.Array, *, kept: bool = False):
    """One-level error feedback: the error of the compression of my reduced
    chunk (in units of the sum) is mine. ``own`` (flat, chunks of ``c``) is
    what my input became (``sent``), with ``error`` added to chunk
    ``owner``; or, with ``kept``, what my input kept (its new residual,
    ``acc - sent``), with ``error`` taken from that chunk."""
    start = owner * c
    part = lax.dynamic_slice(own, (start,), (c,))
    part = part - error if kept else part + error
    return lax.dynamic_update_slice(own, part, (start,))


def _finite(a: jax.Array) -> jax.Array:
    """bool[]: whether every element of ``a`` is finite.

    For real floats as ``sum(a - a)`` being finite: every term is a zero
    but where ``a`` is an inf or a NaN (a NaN), and a sum propagates NaN on
    every backend (XLA does not fold ``a - a`` for floats). One read of
    ``a``, nothing written. Not ``max|a|``: XLA's max propagates NaN, but
    the CPU backend hands large reductions to a library whose max skips NaN
    (jaxlib 0.12: a NaN in a 65,536-element mean read as finite). Not
    ``sum(a * 0)``: XLA:CPU materializes the zero as a tensor of ``a``'s
    size and reads it too. And ``all(isfinite(a))`` first materializes a
    mask of ``a``'s size."""
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.all(jnp.isfinite(a))
    return jnp.isfinite(jnp.sum(a - a))


def all_finite(arrays) -> jax.Array:
    """bool[]: whether every element of every array is finite."""
    flags = [_finite(a) for a in arrays if a is not None]
    return functools.reduce(jnp.logical_and, flags, jnp.bool_(True))
