"""Platform dispatch between FFI kernels and their pure-JAX twins.

This is the only place that decides which implementation runs. ``backend``:
"xla" always runs the twin; "ffi" always calls the kernel (lowering fails on a
platform without one); "auto" runs the kernel on platforms that have one and
the twin elsewhere (TPU, a GPU build without CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax import lax

from jaxcomp._ffi import cpu_available, cuda_available, kernels_line, resolve_backend


def ffi_call(
    target: str,
    results: Sequence[jax.ShapeDtypeStruct],
    *args: jax.Array,
    **attrs: int,
) -> tuple[jax.Array, ...]:
    """Calls an FFI target; integer attributes are passed as exact int64."""
    call = jax.ffi.ffi_call(target, tuple(results), vmap_method="broadcast_all")
    outs = tuple(call(*args, **{k: np.int64(v) for k, v in attrs.items()}))
    # Inside shard_map, an ffi_call's outputs are typed device-invariant even
    # though they depend on per-device inputs; mark them varying over the
    # inputs' axes, as the twin's outputs are (and as they really are).
    axes = _varying_axes(args)
    if axes:
        outs = tuple(lax.pcast(o, axes, to="varying") for o in outs)
    return outs


def _varying_axes(args) -> tuple[str, ...]:
    """Mesh axes over which any of ``args`` varies (empty outside shard_map)."""
    axes: set[str] = set()
    for a in args:
        aval = jax.typeof(a)
        mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.11
        varying = mat.varying if mat is not None else getattr(aval, "vma", None)
        axes |= set(varying or ())
    return tuple(sorted(axes))


def dispatch(
    backend: str,
    kernel: Callable[..., tuple[jax.Array, ...]],
    twin: Callable[..., tuple[jax.Array, ...]],
    *args: jax.Array,
) -> tuple[jax.Array, ...]:
    """Runs ``kernel(*args)`` or ``twin(*args)`` according to ``backend``."""
    backend = resolve_backend(backend)
    if backend == "xla":
        return tuple(twin(*args))
    cpu, cuda = cpu_available(), cuda_available()
    if backend == "ffi":
        if not (cpu or cuda):
            raise RuntimeError(
                f"backend='ffi' but no jaxcomp kernels are loaded: {kernels_line()}. "
                "backend='xla' or 'auto' runs the pure-JAX twins instead"
            )
        return tuple(kernel(*args))
    if any(a.size == 0 for a in args if hasattr(a, "size")):
        # Nothing to compute; the twin handles empty shapes without a custom call.
        return tuple(twin(*args))
    return tuple(
        lax.platform_dependent(
            *args,
            cpu=kernel if cpu else twin,
            cuda=kernel if cuda else twin,
            default=twin,
        )
    )
