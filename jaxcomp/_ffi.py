"""Loading of the compiled FFI modules and registration of their targets.

Registration happens here and only here. The CPU module is always built; the
CUDA module exists only where the package was built with a CUDA toolkit.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import pathlib
import sys

import jax


class Backend(enum.StrEnum):
    """A backend after :func:`resolve_backend`: what
    :func:`jaxcomp.ops._dispatch.dispatch` runs. Resolving applies
    ``JAXCOMP_BACKEND`` once; a resolved value passes through
    :func:`resolve_backend` as it is, so a call that resolves at its entry
    (``Codec.encode``) and hands the value down resolves once."""

    AUTO = "auto"  # the kernel on platforms that have one, the twin elsewhere
    FFI = "ffi"  # the kernel everywhere (lowering fails where there is none)
    XLA = "xla"  # the pure-JAX twin everywhere
    # The kernel on the CPU (where built), the twin elsewhere, where XLA
    # fuses it into what consumes its result (the collectives' decodes).
    FUSED = "fused"
    FUSED_FFI = "fused-ffi"  # "fused" under JAXCOMP_BACKEND=ffi: the CPU kernel required


# What a caller may name, and what JAXCOMP_BACKEND may say.
_BACKENDS = ("auto", "ffi", "xla", "fused")
_ENV_BACKENDS = ("auto", "ffi", "xla")


_PACKAGE = pathlib.Path(__file__).resolve().parent
# Why a module is not loaded, by module name, for the error messages.
_WHY_NOT: dict[str, str] = {}
# The file each loaded module came from, by module name.
_LOADED: dict[str, str] = {}
_WHAT = {"_jaxcomp_cpu": "CPU module", "_jaxcomp_cuda": "CUDA module"}
# How to get a module that was not built: the CUDA module is built only
# where a CUDA compiler is found (CMakeLists.txt, JAXCOMP_CUDA).
_HOW = {
    "_jaxcomp_cpu": "pip install .",
    "_jaxcomp_cuda": "with nvcc on PATH: JAXCOMP_CUDA=ON pip install .",
}


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


def _compiled(pkg: pathlib.Path, module: str) -> pathlib.Path | None:
    """The compiled ``module`` file in the package folder ``pkg``, if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (pkg / f"{module}{suffix}").is_file():
            return pkg / f"{module}{suffix}"
    return None


def _other_packages() -> list[pathlib.Path]:
    """jaxcomp package folders on sys.path other than this one: the
    installed package that a source checkout shadows."""
    found = []
    for entry in sys.path:
        try:
            pkg = pathlib.Path(entry or ".").resolve() / "jaxcomp"
        except OSError:
            continue
        if pkg != _PACKAGE and pkg.is_dir() and pkg not in found:
            found.append(pkg)
    return found


def _installed_elsewhere(module: str) -> list[pathlib.Path]:
    """Compiled ``jaxcomp/<module>`` files on sys.path outside this package:
    the installed build that a source checkout shadows."""
    return [f for pkg in _other_packages() if (f := _compiled(pkg, module))]


def _from_file(module: str, path: str, *, register: bool = True):
    spec = importlib.util.spec_from_file_location(f"jaxcomp.{module}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path!r} is not a loadable module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if register:
        sys.modules[f"jaxcomp.{module}"] = mod
    return mod


def _own(module: str):
    """This package's own compiled ``module`` (ImportError where it has none)."""
    return importlib.import_module(f"jaxcomp.{module}")


def _import(module: str):
    """The compiled module: this package's own, or, where this package is a
    source checkout without compiled modules (``python`` run from the
    repository root after ``pip install .``), the installed one, if it was
    built from the same kernel sources as the checkout. None, with the
    reason in _WHY_NOT, where there is none to load."""
    what = _WHAT.get(module, module)
    try:
        mod = _own(module)
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == f"jaxcomp.{module}":
            pass  # this package has none: look for the installed one below
        else:  # it is there, but it, or something it needs, does not load
            _WHY_NOT[module] = (
                f"the {what} in {_PACKAGE} does not import ({e}); reinstall jaxcomp "
                f"(from its checkout: {_HOW.get(module, 'pip install .')})"
            )
            return None
    else:
        _LOADED[module] = str(getattr(mod, "__file__", "") or _PACKAGE)
        return mod
    root = checkout_root()
    if root is None:
        _WHY_NOT[module] = (
            f"not built: the jaxcomp installed in {_PACKAGE} has no {what}; reinstall it "
            f"(from its checkout: {_HOW.get(module, 'pip install .')})"
        )
        return None
    candidates = _installed_elsewhere(module)
    if not candidates:
        others = _other_packages()
        where = (
            f"the installed jaxcomp ({others[0]}) has none either"
            if others
            else "no jaxcomp is installed elsewhere on sys.path"
        )
        _WHY_NOT[module] = (
            f"not built: this source checkout ({root}) has no compiled {what} and {where}; "
            f"install the package from this checkout ({_HOW.get(module, 'pip install .')})"
        )
        return None
    return _matching_build(module, root, candidates)


def _matching_build(module: str, root, candidates):
    """The first of the installed builds ``candidates`` compiled from the
    checkout's kernel sources, registered as this package's; None, with the
    reason in _WHY_NOT, where none was."""
    want = kernel_sources_hash(root)
    for path in candidates:
        try:
            mod = _from_file(module, str(path), register=False)
        except ImportError as e:
            _WHY_NOT[module] = (
                f"the installed build ({path}) does not import ({e}); reinstall it from "
                f"the checkout (pip install . in {root})"
            )
            continue
        got = getattr(mod, "source_hash", lambda: None)()
        if got == want:
            sys.modules[f"jaxcomp.{module}"] = mod
            _LOADED[module] = str(path)
            return mod
        # The wording is quoted in docs/gpu.md ("A source checkout and the
        # installed kernels").
        _WHY_NOT[module] = (
            f"the installed build ({path}) was compiled from other kernel sources than "
            f"this source checkout ({root}); reinstall it from the checkout (pip install .)"
        )
    return None


@functools.cache
def _module(module: str):
    """:func:`_import`, once per process."""
    return _import(module)


@functools.cache
def _load(module: str, platform: str) -> bool:
    # JAXCOMP_CPU_MODULE: a path to another build of the CPU module (the
    # sanitizer build of .ci/sanitize), loaded instead of the installed one.
    # A path that does not load is an error, not a fallback to the twins: the
    # run that names a build means to test that build.
    path = os.environ.get("JAXCOMP_CPU_MODULE", "") if module == "_jaxcomp_cpu" else ""
    if path:
        try:
            if not os.path.isfile(path):
                raise ImportError("no such file")
            mod = _from_file(module, path)
        except ImportError as e:
            _WHY_NOT[module] = (
                f"JAXCOMP_CPU_MODULE={path!r} does not load ({e}); it names a build of the "
                "CPU module to load instead of the installed one (e.g. .ci/sanitize's); "
                "fix the path or unset it"
            )
            raise ImportError(f"jaxcomp: {_WHY_NOT[module]}") from None
        _LOADED[module] = path
    else:
        mod = _module(module)
        if mod is None:
            return False
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return True


def _cuda_gpus() -> list:
    """The CUDA devices JAX sees (none where its CUDA backend is absent)."""
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


def _no_gpu() -> str:
    """Why JAX sees no CUDA GPU, as far as this process can tell."""
    platforms = sorted({d.platform for d in jax.devices()})
    text = f"no CUDA GPU visible to JAX (its devices: {', '.join(platforms)}"
    env = os.environ.get("JAX_PLATFORMS", "")
    if env and "cuda" not in env.lower():
        text += f"; JAX_PLATFORMS={env}"
    return text + ")"


def _cuda_module_state() -> str:
    """Whether a CUDA module is there to load, for a process without a GPU
    (importing it touches no GPU: cudart is linked statically)."""
    if _module("_jaxcomp_cuda") is not None:
        return f"the CUDA module is installed ({_LOADED['_jaxcomp_cuda']}) but has no GPU to run on"
    why = _WHY_NOT.get("_jaxcomp_cuda", "not built")
    if why.startswith("not built"):  # the usual CPU-only install: no advice needed
        return "no CUDA module is built either (it is built where nvcc is found)"
    return f"CUDA module: {why}"


def why_not_loaded(module: str) -> str:
    """Why ``module`` (_jaxcomp_cpu, _jaxcomp_cuda) is not loaded, for
    messages; "loaded from <file>" where it is."""
    if module == "_jaxcomp_cuda" and not _cuda_gpus():
        return f"not loaded: {_no_gpu()}; {_cuda_module_state()}"
    try:
        available = cpu_available() if module == "_jaxcomp_cpu" else cuda_available()
    except ImportError:  # JAXCOMP_CPU_MODULE names a build that does not load
        available = False
    if available:
        return f"loaded from {_LOADED[module]}"
    return _WHY_NOT.get(module, f"{module}: not a jaxcomp module")


def cpu_available() -> bool:
    """Whether the CPU kernels are built and registered."""
    return _load("_jaxcomp_cpu", "cpu")


@functools.cache
def cuda_available() -> bool:
    """Whether the CUDA kernels are built and registered (needs a CUDA backend)."""
    if not _cuda_gpus():
        return False
    return _load("_jaxcomp_cuda", "CUDA")


def cpu_isa() -> str | None:
    """The instruction set the CPU kernels were dispatched to ("avx2", "base"),
    or None where they are not loaded (:func:`why_not_loaded` says why)."""
    try:
        if not cpu_available():
            return None
    except ImportError:  # JAXCOMP_CPU_MODULE names a build that does not load
        return None
    return sys.modules["jaxcomp._jaxcomp_cpu"].isa()


def _origin(module: str) -> str:
    """Where a loaded module came from, where that is not this package."""
    path = pathlib.Path(_LOADED.get(module, ""))
    if module == "_jaxcomp_cpu" and os.environ.get("JAXCOMP_CPU_MODULE"):
        return f" (JAXCOMP_CPU_MODULE: {path})"
    if path.parent != _PACKAGE and checkout_root() is not None:
        return f" (the installed build in {path.parent}, built from this checkout's sources)"
    return ""


def kernels_line() -> str:
    """One line on the kernels this process runs, by platform: "CPU kernels
    avx2; CUDA kernels on NVIDIA H200", or why a platform has none: no
    CUDA GPU visible to JAX, a module not built, or built from other kernel
    sources than this checkout."""
    try:
        cpu_ok = cpu_available()
    except ImportError as e:  # JAXCOMP_CPU_MODULE names a build that does not load
        cpu, cpu_ok = f"CPU kernels not loaded: {_WHY_NOT.get('_jaxcomp_cpu', e)}", None
    if cpu_ok:
        cpu = f"CPU kernels {cpu_isa()}{_origin('_jaxcomp_cpu')}"
    elif cpu_ok is not None:
        cpu = f"CPU kernels not loaded: {why_not_loaded('_jaxcomp_cpu')}"
    gpus = _cuda_gpus()
    if not gpus:
        return f"{cpu}; {_no_gpu()}, so no CUDA kernels run; {_cuda_module_state()}"
    if cuda_available():
        return f"{cpu}; CUDA kernels on {gpus[0].device_kind}{_origin('_jaxcomp_cuda')}"
    return (
        f"{cpu}; CUDA kernels not loaded on the {gpus[0].device_kind}: "
        f"{why_not_loaded('_jaxcomp_cuda')}"
    )


def resolve_backend(backend: str) -> Backend:
    """Validates ``backend`` and applies the ``JAXCOMP_BACKEND`` override.

    ``JAXCOMP_BACKEND=xla`` sends every "auto" and "fused" call to the
    pure-JAX twins; ``JAXCOMP_BACKEND=ffi`` makes "auto" require the
    kernels, and "fused" require them on the CPU. A :class:`Backend` is
    already resolved and is returned as it is.
    """
    if isinstance(backend, Backend):
        return backend
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend in ("ffi", "xla"):
        return Backend(backend)
    env = os.environ.get("JAXCOMP_BACKEND", "auto").strip().lower() or "auto"
    if env not in _ENV_BACKENDS:
        raise ValueError(f"JAXCOMP_BACKEND must be one of {_ENV_BACKENDS}, got {env!r}")
    if backend == "auto":
        return Backend(env)
    return {"auto": Backend.FUSED, "ffi": Backend.FUSED_FFI, "xla": Backend.XLA}[env]
