"""Loading of the compiled FFI modules and registration of their targets.

Registration happens here and only here. The CPU module is always built; the
CUDA module exists only where the package was built with a CUDA toolkit.
"""

from __future__ import annotations

import enum
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
# JAXCOMP_BACKEND is read once, when jaxcomp is imported: it is the default
# of every "auto" and "fused" call. A value read at trace time would not be
# part of what jit caches, so changing it later would do nothing, silently.
_DEFAULT = os.environ.get("JAXCOMP_BACKEND", "auto").strip().lower() or "auto"


_PACKAGE = pathlib.Path(__file__).resolve().parent
_WHAT = {"_jaxcomp_cpu": "CPU module", "_jaxcomp_cuda": "CUDA module"}
# How to get a module that was not built: the CUDA module is built only
# where a CUDA compiler is found (CMakeLists.txt, JAXCOMP_CUDA).
_HOW = {
    "_jaxcomp_cpu": "pip install .",
    "_jaxcomp_cuda": "with nvcc on PATH: JAXCOMP_CUDA=ON pip install .",
}


def checkout_root(package: pathlib.Path = _PACKAGE) -> pathlib.Path | None:
    """The source checkout ``package`` (default: this one) was imported
    from (the folder holding jaxcomp/, ffi/ and cuda/), or None for an
    installed package."""
    root = package.parent
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


class Loader:
    """Finds, loads and registers the compiled kernel modules
    (``_jaxcomp_cpu``, ``_jaxcomp_cuda``), and says why one is not loaded.

    One instance, :data:`LOADER`, serves the process (the module functions
    :func:`cpu_available`, :func:`cuda_available`, :func:`kernels_line`, ...
    ask it). Its view of the world is a handful of methods, each one
    question (:meth:`own`, :meth:`checkout_root`, :meth:`installed_elsewhere`,
    :meth:`other_packages`, :meth:`from_file`, :meth:`cuda_gpus`), which a
    test replaces on an instance of its own to simulate an install; what
    it found is in :attr:`loaded` (the file of each loaded module) and
    :attr:`why_not` (why a module is not loaded).

    ``JAXCOMP_CPU_MODULE``, a documented option (docs/wire-format.md), names
    another build of the CPU module to load instead of the installed one
    (the sanitizer build of .ci/sanitize); a path that does not load is an
    error, not a fallback to the twins: the run that names a build means to
    test that build.
    """

    def __init__(self, package: pathlib.Path = _PACKAGE):
        self.package = package
        self.why_not: dict[str, str] = {}  # by module name, for the messages
        self.loaded: dict[str, str] = {}  # the file each loaded module came from
        self._modules: dict[str, object] = {}
        self._registered: dict[str, bool] = {}
        self._cuda: bool | None = None

    # -- the world, one question each --------------------------------------
    def own(self, module: str):
        """This package's own compiled ``module`` (ImportError where it has none)."""
        return importlib.import_module(f"jaxcomp.{module}")

    def checkout_root(self) -> pathlib.Path | None:
        """The source checkout this package was imported from, if any."""
        return checkout_root(self.package)

    def other_packages(self) -> list[pathlib.Path]:
        """jaxcomp package folders on sys.path other than this one: the
        installed package that a source checkout shadows."""
        found = []
        for entry in sys.path:
            try:
                pkg = pathlib.Path(entry or ".").resolve() / "jaxcomp"
            except OSError:
                continue
            if pkg != self.package and pkg.is_dir() and pkg not in found:
                found.append(pkg)
        return found

    def installed_elsewhere(self, module: str) -> list[pathlib.Path]:
        """Compiled ``jaxcomp/<module>`` files on sys.path outside this
        package: the installed build that a source checkout shadows."""
        return [f for pkg in self.other_packages() if (f := _compiled(pkg, module))]

    def from_file(self, module: str, path: str, *, register: bool = True):
        """The compiled ``module`` loaded from ``path``."""
        spec = importlib.util.spec_from_file_location(f"jaxcomp.{module}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path!r} is not a loadable module")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if register:
            sys.modules[f"jaxcomp.{module}"] = mod
        return mod

    def cuda_gpus(self) -> list:
        """The CUDA devices JAX sees (none where its CUDA backend is absent)."""
        try:
            return jax.devices("cuda")
        except RuntimeError:
            return []

    # -- finding a module ----------------------------------------------------
    def import_module(self, module: str):
        """The compiled module: this package's own, or, where this package
        is a source checkout without compiled modules (``python`` run from
        the repository root after ``pip install .``), the installed one, if
        it was built from the same kernel sources as the checkout. None,
        with the reason in :attr:`why_not`, where there is none to load."""
        what = _WHAT.get(module, module)
        try:
            mod = self.own(module)
        except ImportError as e:
            if isinstance(e, ModuleNotFoundError) and e.name == f"jaxcomp.{module}":
                pass  # this package has none: look for the installed one below
            else:  # it is there, but it, or something it needs, does not load
                self.why_not[module] = (
                    f"the {what} in {self.package} does not import ({e}); reinstall jaxcomp "
                    f"(from its checkout: {_HOW.get(module, 'pip install .')})"
                )
                return None
        else:
            self.loaded[module] = str(getattr(mod, "__file__", "") or self.package)
            return mod
        root = self.checkout_root()
        if root is None:
            self.why_not[module] = (
                f"not built: the jaxcomp installed in {self.package} has no {what}; reinstall "
                f"it (from its checkout: {_HOW.get(module, 'pip install .')})"
            )
            return None
        candidates = self.installed_elsewhere(module)
        if not candidates:
            others = self.other_packages()
            where = (
                f"the installed jaxcomp ({others[0]}) has none either"
                if others
                else "no jaxcomp is installed elsewhere on sys.path"
            )
            self.why_not[module] = (
                f"not built: this source checkout ({root}) has no compiled {what} and {where}; "
                f"install the package from this checkout ({_HOW.get(module, 'pip install .')})"
            )
            return None
        return self._matching_build(module, root, candidates)

    def _matching_build(self, module: str, root, candidates):
        """The first of the installed builds ``candidates`` compiled from the
        checkout's kernel sources, registered as this package's; None, with
        the reason in :attr:`why_not`, where none was."""
        want = kernel_sources_hash(root)
        for path in candidates:
            try:
                mod = self.from_file(module, str(path), register=False)
            except ImportError as e:
                self.why_not[module] = (
                    f"the installed build ({path}) does not import ({e}); reinstall it from "
                    f"the checkout (pip install . in {root})"
                )
                continue
            got = getattr(mod, "source_hash", lambda: None)()
            if got == want:
                sys.modules[f"jaxcomp.{module}"] = mod
                self.loaded[module] = str(path)
                return mod
            # The wording is quoted in docs/gpu.md ("A source checkout and the
            # installed kernels").
            self.why_not[module] = (
                f"the installed build ({path}) was compiled from other kernel sources than "
                f"this source checkout ({root}); reinstall it from the checkout (pip install .)"
            )
        return None

    def module(self, module: str):
        """:meth:`import_module`, once per loader."""
        if module not in self._modules:
            self._modules[module] = self.import_module(module)
        return self._modules[module]

    def load(self, module: str, platform: str) -> bool:
        """Whether ``module`` is loaded and its targets registered for
        ``platform`` (done once per loader). ImportError where
        ``JAXCOMP_CPU_MODULE`` names a build that does not load."""
        if module not in self._registered:
            self._registered[module] = self._load(module, platform)
        return self._registered[module]

    def _load(self, module: str, platform: str) -> bool:
        path = os.environ.get("JAXCOMP_CPU_MODULE", "") if module == "_jaxcomp_cpu" else ""
        if path:
            try:
                if not os.path.isfile(path):
                    raise ImportError("no such file")
                mod = self.from_file(module, path)
            except ImportError as e:
                self.why_not[module] = (
                    f"JAXCOMP_CPU_MODULE={path!r} does not load ({e}); it names a build of the "
                    "CPU module to load instead of the installed one (e.g. .ci/sanitize's); "
                    "fix the path or unset it"
                )
                raise ImportError(f"jaxcomp: {self.why_not[module]}") from None
            self.loaded[module] = path
        else:
            mod = self.module(module)
            if mod is None:
                return False
        for name, capsule in mod.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        return True

    # -- what the rest of the package asks -----------------------------------
    def cpu_available(self) -> bool:
        """Whether the CPU kernels are built and registered."""
        return self.load("_jaxcomp_cpu", "cpu")

    def cuda_available(self) -> bool:
        """Whether the CUDA kernels are built and registered (needs a CUDA
        backend); asked once per loader, as every kernel call asks it."""
        if self._cuda is None:
            self._cuda = bool(self.cuda_gpus()) and self.load("_jaxcomp_cuda", "CUDA")
        return self._cuda

    def cpu_isa(self) -> str | None:
        """The instruction set the CPU kernels were dispatched to ("avx2",
        "base"), or None where they are not loaded."""
        try:
            if not self.cpu_available():
                return None
        except ImportError:  # JAXCOMP_CPU_MODULE names a build that does not load
            return None
        return sys.modules["jaxcomp._jaxcomp_cpu"].isa()

    def no_gpu(self) -> str:
        """Why JAX sees no CUDA GPU, as far as this process can tell."""
        platforms = sorted({d.platform for d in jax.devices()})
        text = f"no CUDA GPU visible to JAX (its devices: {', '.join(platforms)}"
        env = os.environ.get("JAX_PLATFORMS", "")
        if env and "cuda" not in env.lower():
            text += f"; JAX_PLATFORMS={env}"
        return text + ")"

    def _cuda_module_state(self) -> str:
        """Whether a CUDA module is there to load, for a process without a GPU
        (importing it touches no GPU: cudart is linked statically)."""
        if self.module("_jaxcomp_cuda") is not None:
            return (
                f"the CUDA module is installed ({self.loaded['_jaxcomp_cuda']}) but has no GPU "
                "to run on"
            )
        why = self.why_not.get("_jaxcomp_cuda", "not built")
        if why.startswith("not built"):  # the usual CPU-only install: no advice needed
            return "no CUDA module is built either (it is built where nvcc is found)"
        return f"CUDA module: {why}"

    def why_not_loaded(self, module: str) -> str:
        """Why ``module`` (_jaxcomp_cpu, _jaxcomp_cuda) is not loaded, for
        messages; "loaded from <file>" where it is."""
        if module == "_jaxcomp_cuda" and not self.cuda_gpus():
            return f"not loaded: {self.no_gpu()}; {self._cuda_module_state()}"
        try:
            available = self.cpu_available() if module == "_jaxcomp_cpu" else self.cuda_available()
        except ImportError:  # JAXCOMP_CPU_MODULE names a build that does not load
            available = False
        if available:
            return f"loaded from {self.loaded[module]}"
        return self.why_not.get(module, f"{module}: not a jaxcomp module")

    def _origin(self, module: str) -> str:
        """Where a loaded module came from, where that is not this package."""
        path = pathlib.Path(self.loaded.get(module, ""))
        if module == "_jaxcomp_cpu" and os.environ.get("JAXCOMP_CPU_MODULE"):
            return f" (JAXCOMP_CPU_MODULE: {path})"
        if path.parent != self.package and self.checkout_root() is not None:
            return f" (the installed build in {path.parent}, built from this checkout's sources)"
        return ""

    def kernels_line(self) -> str:
        """One line on the kernels this process runs, by platform: "CPU
        kernels avx2; CUDA kernels on NVIDIA H200", or why a platform has
        none: no CUDA GPU visible to JAX, a module not built, or built from
        other kernel sources than this checkout."""
        try:
            cpu_ok = self.cpu_available()
        except ImportError as e:  # JAXCOMP_CPU_MODULE names a build that does not load
            why = self.why_not.get("_jaxcomp_cpu", e)
            cpu, cpu_ok = f"CPU kernels not loaded: {why}", None
        if cpu_ok:
            cpu = f"CPU kernels {self.cpu_isa()}{self._origin('_jaxcomp_cpu')}"
        elif cpu_ok is not None:
            cpu = f"CPU kernels not loaded: {self.why_not_loaded('_jaxcomp_cpu')}"
        gpus = self.cuda_gpus()
        if not gpus:
            return f"{cpu}; {self.no_gpu()}, so no CUDA kernels run; {self._cuda_module_state()}"
        if self.cuda_available():
            return f"{cpu}; CUDA kernels on {gpus[0].device_kind}{self._origin('_jaxcomp_cuda')}"
        return (
            f"{cpu}; CUDA kernels not loaded on the {gpus[0].device_kind}: "
            f"{self.why_not_loaded('_jaxcomp_cuda')}"
        )


#: The process's loader.
LOADER = Loader()


def cpu_available() -> bool:
    """Whether the CPU kernels are built and registered."""
    return LOADER.cpu_available()


def cuda_available() -> bool:
    """Whether the CUDA kernels are built and registered (needs a CUDA backend)."""
    return LOADER.cuda_available()


def cpu_isa() -> str | None:
    """The instruction set the CPU kernels were dispatched to ("avx2", "base"),
    or None where they are not loaded (:func:`why_not_loaded` says why)."""
    return LOADER.cpu_isa()


def why_not_loaded(module: str) -> str:
    """Why ``module`` (_jaxcomp_cpu, _jaxcomp_cuda) is not loaded, for
    messages; "loaded from <file>" where it is."""
    return LOADER.why_not_loaded(module)


def kernels_line() -> str:
    """One line on the kernels this process runs, by platform (:meth:`Loader.kernels_line`)."""
    return LOADER.kernels_line()


def resolve_backend(backend: str) -> Backend:
    """Validates ``backend`` and applies the ``JAXCOMP_BACKEND`` default
    (read when jaxcomp was imported).

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
    env = _DEFAULT
    if env not in _ENV_BACKENDS:
        raise ValueError(
            f"JAXCOMP_BACKEND must be one of {_ENV_BACKENDS}, got {env!r} (read when jaxcomp "
            "was imported)"
        )
    if backend == "auto":
        return Backend(env)
    return {"auto": Backend.FUSED, "ffi": Backend.FUSED_FFI, "xla": Backend.XLA}[env]
