"""Float conversion: FFI target ``jaxcomp_cast`` (round to nearest even) and
its twin, ``astype``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.ops._dispatch import dispatch, ffi_call


def cast(x, dtype, *, backend: str = "auto"):
    """x converted to dtype (float32, bfloat16 or float16), same shape."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    shape = x.shape
    flat = x.reshape(-1)
    out = jax.ShapeDtypeStruct(flat.shape, dtype)

    def kernel(flat):
        return ffi_call("jaxcomp_cast", (out,), flat)

    return dispatch(backend, kernel, lambda flat: (flat.astype(dtype),), flat)[0].reshape(shape)
