"""Loading of the compiled FFI modules and registration of their targets.

Registration happens here and only here. The CPU module is always built; the
CUDA module exists only where the package was built with a CUDA toolkit.
"""

from __future__ import annotations

import functools
import importlib
import os

import jax

_BACKENDS = ("auto", "ffi", "xla")


@functools.cache
def _load(module: str, platform: str) -> bool:
    try:
        mod = importlib.import_module(f"jaxcomp.{module}")
    except ImportError:
        return False
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return True


def cpu_available() -> bool:
    """Whether the CPU kernels are built and registered."""
    return _load("_jaxcomp_cpu", "cpu")


@functools.cache
def cuda_available() -> bool:
    """Whether the CUDA kernels are built and registered (needs a CUDA backend)."""
    try:
        if not jax.devices("cuda"):
            return False
    except RuntimeError:
        return False
    return _load("_jaxcomp_cuda", "CUDA")


def cpu_isa() -> str | None:
    """The instruction set the CPU kernels were dispatched to ("avx2", "base")."""
    if not cpu_available():
        return None
    from jaxcomp import _jaxcomp_cpu

    return _jaxcomp_cpu.isa()


def resolve_backend(backend: str) -> str:
    """Validates ``backend`` and applies the ``JAXCOMP_BACKEND`` override.

    ``JAXCOMP_BACKEND=xla`` sends every "auto" call to the pure-JAX twins;
    ``JAXCOMP_BACKEND=ffi`` makes "auto" require the kernels.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get("JAXCOMP_BACKEND", "auto").strip().lower() or "auto"
        if env not in _BACKENDS:
            raise ValueError(f"JAXCOMP_BACKEND must be one of {_BACKENDS}, got {env!r}")
        return env
    return backend
