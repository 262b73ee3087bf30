"""Loading of the compiled FFI modules and registration of their targets.

Registration happens here and only here. The CPU module is always built; the
CUDA module exists only where the package was built with a CUDA toolkit.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

import jax

_BACKENDS = ("auto", "ffi", "xla")


@functools.cache
def _load(module: str, platform: str) -> bool:
    # JAXCOMP_CPU_MODULE: a path to another build of the CPU module (the
    # sanitizer build of .ci/sanitize), loaded instead of the installed one.
    path = os.environ.get("JAXCOMP_CPU_MODULE", "") if module == "_jaxcomp_cpu" else ""
    try:
        if path:
            spec = importlib.util.spec_from_file_location(f"jaxcomp.{module}", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"JAXCOMP_CPU_MODULE={path!r} is not a loadable module")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            sys.modules[f"jaxcomp.{module}"] = mod
        else:
            mod = importlib.import_module(f"jaxcomp.{module}")
    except ImportError:
        if path:
            raise
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
