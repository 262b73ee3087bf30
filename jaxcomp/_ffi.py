"""Loading of the compiled FFI modules and registration of their targets.

Registration happens here and only here. The CPU module is always built; the
CUDA module exists only where the package was built with a CUDA toolkit.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import pathlib
import sys

import jax

_BACKENDS = ("auto", "ffi", "xla")


_PACKAGE = pathlib.Path(__file__).resolve().parent
# Why a module is not loaded, by module name, for the error messages.
_WHY_NOT: dict[str, str] = {}


def checkout_root() -> pathlib.Path | None:
    """The source checkout this package was imported from (the folder
    holding jaxcomp/, ffi/ and cuda/), or None for an installed package."""
    root = _PACKAGE.parent
    if (root / "ffi" / "module.cc").is_file() and (root / "CMakeLists.txt").is_file():
        return root
    return None


def kernel_sources_hash(root: pathlib.Path) -> str:
    """The hash of the kernel sources under ``root`` (every file under ffi/
    and cuda/), by the recipe of CMakeLists.txt that compiles it into the
    modules as source_hash()."""
    files = sorted(
        p.relative_to(root).as_posix()
        for d in ("ffi", "cuda")
        for p in (root / d).rglob("*")
        if p.is_file()
    )
    text = "".join(f"{f}\n{hashlib.sha256((root / f).read_bytes()).hexdigest()}\n" for f in files)
    return hashlib.sha256(text.encode()).hexdigest()


def _installed_elsewhere(module: str) -> list[pathlib.Path]:
    """Compiled ``jaxcomp/<module>`` files on sys.path outside this package:
    the installed build that a source checkout shadows."""
    found = []
    for entry in sys.path:
        try:
            pkg = pathlib.Path(entry or ".").resolve() / "jaxcomp"
        except OSError:
            continue
        if pkg == _PACKAGE or not pkg.is_dir():
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if (pkg / f"{module}{suffix}").is_file():
                found.append(pkg / f"{module}{suffix}")
                break
    return found


def _from_file(module: str, path: str):
    spec = importlib.util.spec_from_file_location(f"jaxcomp.{module}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path!r} is not a loadable module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[f"jaxcomp.{module}"] = mod
    return mod


def _import(module: str):
    """The compiled module: this package's own, or, where this package is a
    source checkout without compiled modules (``python`` run from the
    repository root after ``pip install .``), the installed one, if it was
    built from the same kernel sources as the checkout. None, with the
    reason in _WHY_NOT, where there is none to load."""
    try:
        return importlib.import_module(f"jaxcomp.{module}")
    except ImportError as e:
        own_error = e
    root = checkout_root()
    if root is None:
        _WHY_NOT[module] = f"not built ({own_error}); reinstall the package (pip install .)"
        return None
    candidates = _installed_elsewhere(module)
    if not candidates:
        _WHY_NOT[module] = (
            f"not built: this source checkout ({root}) has none, and no installed jaxcomp "
            "on sys.path has one; install the package (pip install .)"
        )
        return None
    want = kernel_sources_hash(root)
    for path in candidates:
        mod = _from_file(module, str(path))
        got = getattr(mod, "source_hash", lambda: None)()
        if got == want:
            return mod
        del sys.modules[f"jaxcomp.{module}"]
    _WHY_NOT[module] = (
        f"the installed build ({candidates[0]}) was compiled from other kernel sources than "
        f"this source checkout ({root}); reinstall it from the checkout (pip install .)"
    )
    return None


@functools.cache
def _load(module: str, platform: str) -> bool:
    # JAXCOMP_CPU_MODULE: a path to another build of the CPU module (the
    # sanitizer build of .ci/sanitize), loaded instead of the installed one.
    path = os.environ.get("JAXCOMP_CPU_MODULE", "") if module == "_jaxcomp_cpu" else ""
    if path:
        mod = _from_file(module, path)
    else:
        mod = _import(module)
        if mod is None:
            return False
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return True


def why_not_loaded(module: str) -> str:
    """Why ``module`` (_jaxcomp_cpu, _jaxcomp_cuda) is not loaded, for messages."""
    return _WHY_NOT.get(module, "not built")


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
    return sys.modules["jaxcomp._jaxcomp_cpu"].isa()


def kernels_line() -> str:
    """One line on the kernels this process runs, by platform: "CPU kernels
    avx2; CUDA kernels on NVIDIA H200", or why a platform has none."""
    cpu = f"CPU kernels {cpu_isa() if cpu_available() else why_not_loaded('_jaxcomp_cpu')}"
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        gpus = []
    if not gpus:
        return f"{cpu}; no CUDA GPU visible to JAX"
    if cuda_available():
        return f"{cpu}; CUDA kernels on {gpus[0].device_kind}"
    return f"{cpu}; CUDA kernels {why_not_loaded('_jaxcomp_cuda')} ({gpus[0].device_kind})"


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
