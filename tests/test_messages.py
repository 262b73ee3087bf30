"""The messages a new user meets first: why the kernels are or are not
loaded (jaxcomp/_ffi.py, and backend="ffi" without them), a codec name or
parameter that does not exist (jc.codecs.get), and onebit_adam without its
warm-up. Each situation is simulated (the import, the hash, the GPUs),
not built."""

from __future__ import annotations

import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import pytest

import jaxcomp as jc
from jaxcomp import _ffi
from jaxcomp.ops import _dispatch

CPU, CUDA = "_jaxcomp_cpu", "_jaxcomp_cuda"
# The platforms of JAX's default devices (cpu here; cuda on a GPU machine,
# where these tests pretend that there is none).
PLATFORMS = ", ".join(sorted({d.platform for d in jax.devices()}))


@pytest.fixture
def ffi(monkeypatch):
    """A fresh loader as the process's (``_ffi.LOADER``), its view of the
    world patchable; sys.modules and the environment restored afterwards."""
    monkeypatch.setattr(_ffi, "LOADER", _ffi.Loader())
    monkeypatch.delenv("JAXCOMP_CPU_MODULE", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    names = [f"jaxcomp.{m}" for m in (CPU, CUDA)]
    before = {n: sys.modules.get(n) for n in names}
    yield monkeypatch
    for n, mod in before.items():
        if mod is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = mod


def _absent(module):
    raise ModuleNotFoundError(f"No module named 'jaxcomp.{module}'", name=f"jaxcomp.{module}")


def _checkout(ffi, root, installed=(), packages=None):
    """A source checkout at ``root`` without compiled modules, beside
    installed builds ``installed``."""
    ffi.setattr(_ffi.LOADER, "own", _absent)
    ffi.setattr(_ffi.LOADER, "checkout_root", lambda: root)
    ffi.setattr(_ffi.LOADER, "installed_elsewhere", lambda module: list(installed))
    pkgs = [pathlib.Path(p).parent for p in installed] if packages is None else packages
    ffi.setattr(_ffi.LOADER, "other_packages", lambda: pkgs)


# ---------------------------------------------------------------------------
# Why a module is (not) loaded
# ---------------------------------------------------------------------------
def test_an_installed_package_without_the_module_is_not_built(ffi):
    ffi.setattr(_ffi.LOADER, "own", _absent)
    ffi.setattr(_ffi.LOADER, "checkout_root", lambda: None)
    assert _ffi.LOADER.import_module(CPU) is None
    assert _ffi.LOADER.why_not[CPU].startswith(
        f"not built: the jaxcomp installed in {_ffi.LOADER.package} has no CPU module; reinstall it"
    )
    assert _ffi.LOADER.import_module(CUDA) is None
    assert "has no CUDA module" in _ffi.LOADER.why_not[CUDA]
    assert "JAXCOMP_CUDA=ON pip install ." in _ffi.LOADER.why_not[CUDA]


def test_a_module_that_is_there_but_does_not_import_is_not_called_not_built(ffi):
    def broken(module):
        raise ImportError("libcudart.so.13: cannot open shared object file")

    ffi.setattr(_ffi.LOADER, "own", broken)
    assert _ffi.LOADER.import_module(CUDA) is None
    why = _ffi.LOADER.why_not[CUDA]
    assert "not built" not in why
    assert why.startswith(f"the CUDA module in {_ffi.LOADER.package} does not import (libcudart")


def test_a_checkout_with_nothing_installed_is_not_built(ffi, tmp_path):
    _checkout(ffi, tmp_path, packages=[])
    assert _ffi.LOADER.import_module(CPU) is None
    assert _ffi.LOADER.why_not[CPU] == (
        f"not built: this source checkout ({tmp_path}) has no compiled CPU module and no "
        "jaxcomp is installed elsewhere on sys.path; install the package from this "
        "checkout (pip install .)"
    )


def test_a_checkout_beside_an_install_without_the_module(ffi, tmp_path):
    site = tmp_path / "site" / "jaxcomp"
    _checkout(ffi, tmp_path, packages=[site])
    assert _ffi.LOADER.import_module(CUDA) is None
    why = _ffi.LOADER.why_not[CUDA]
    assert why.startswith(f"not built: this source checkout ({tmp_path}) has no compiled CUDA")
    assert f"the installed jaxcomp ({site}) has none either" in why


def test_an_install_from_other_sources_says_so_and_how_to_fix_it(ffi, tmp_path):
    installed = tmp_path / "site" / "jaxcomp" / "_jaxcomp_cpu.so"
    _checkout(ffi, tmp_path / "checkout", installed=[installed])
    ffi.setattr(_ffi, "kernel_sources_hash", lambda root: "a" * 64)
    fake = types.SimpleNamespace(source_hash=lambda: "b" * 64)
    ffi.setattr(_ffi.LOADER, "from_file", lambda module, path, register=True: fake)
    assert _ffi.LOADER.import_module(CPU) is None
    why = _ffi.LOADER.why_not[CPU]
    assert "not built" not in why
    assert why == (
        f"the installed build ({installed}) was compiled from other kernel sources than this "
        f"source checkout ({tmp_path / 'checkout'}); reinstall it from the checkout "
        "(pip install .)"
    )


def test_an_installed_build_that_does_not_import(ffi, tmp_path):
    installed = tmp_path / "site" / "jaxcomp" / "_jaxcomp_cpu.so"
    _checkout(ffi, tmp_path / "checkout", installed=[installed])

    def broken(module, path, register=True):
        raise ImportError("undefined symbol: _ZN3xla3ffi")

    ffi.setattr(_ffi.LOADER, "from_file", broken)
    assert _ffi.LOADER.import_module(CPU) is None
    assert _ffi.LOADER.why_not[CPU] == (
        f"the installed build ({installed}) does not import (undefined symbol: _ZN3xla3ffi); "
        f"reinstall it from the checkout (pip install . in {tmp_path / 'checkout'})"
    )


def test_an_install_from_the_same_sources_is_loaded_and_says_from_where(ffi, tmp_path):
    installed = tmp_path / "site" / "jaxcomp" / "_jaxcomp_cpu.so"
    _checkout(ffi, tmp_path / "checkout", installed=[installed])
    ffi.setattr(_ffi, "kernel_sources_hash", lambda root: "a" * 64)
    fake = types.SimpleNamespace(source_hash=lambda: "a" * 64, isa=lambda: "avx2")
    ffi.setattr(_ffi.LOADER, "from_file", lambda module, path, register=True: fake)
    assert _ffi.LOADER.import_module(CPU) is fake
    assert _ffi.LOADER.loaded[CPU] == str(installed)
    ffi.setattr(_ffi.LOADER, "cpu_available", lambda: True)
    assert _ffi.why_not_loaded(CPU) == f"loaded from {installed}"
    ffi.setattr(_ffi.LOADER, "cuda_gpus", lambda: [])
    ffi.setattr(_ffi.LOADER, "module", lambda module: None)
    _ffi.LOADER.why_not[CUDA] = "not built: ..."
    assert _ffi.kernels_line().startswith(
        f"CPU kernels avx2 (the installed build in {installed.parent}, built from this "
        "checkout's sources); "
    )


def test_loaded_kernels_are_not_called_not_built():
    """This process: why_not_loaded used to answer "not built" for a
    module that was loaded."""
    if not jc.cpu_available():
        pytest.skip("CPU kernels not loaded here")
    assert _ffi.why_not_loaded(CPU).startswith("loaded from ")
    assert not _ffi.kernels_line().startswith("CPU kernels not")


def test_a_missing_jaxcomp_cpu_module_names_the_variable(ffi, tmp_path):
    missing = tmp_path / "missing.so"
    ffi.setenv("JAXCOMP_CPU_MODULE", str(missing))
    load = _ffi.LOADER.load  # a fresh loader's: not the process's answer
    with pytest.raises(ImportError, match=r"JAXCOMP_CPU_MODULE='.*missing\.so' does not load"):
        load(CPU, "cpu")
    ffi.setattr(_ffi.LOADER, "cpu_available", lambda: load(CPU, "cpu"))
    ffi.setattr(_ffi.LOADER, "cuda_gpus", lambda: [])
    ffi.setattr(_ffi.LOADER, "module", lambda module: None)
    _ffi.LOADER.why_not[CUDA] = "not built: ..."
    line = _ffi.kernels_line()
    assert line.startswith("CPU kernels not loaded: JAXCOMP_CPU_MODULE=")
    assert "(no such file)" in line and "unset it" in line


# ---------------------------------------------------------------------------
# kernels_line (python -m jaxcomp info, demo): the three CUDA situations
# ---------------------------------------------------------------------------
@pytest.fixture
def cpu_only(ffi):
    """A process with the CPU kernels of this package and no GPU."""
    ffi.setattr(_ffi.LOADER, "cpu_available", lambda: True)
    ffi.setattr(_ffi.LOADER, "cpu_isa", lambda: "avx2")
    ffi.setattr(_ffi.LOADER, "cuda_gpus", lambda: [])
    ffi.setattr(_ffi.LOADER, "module", lambda module: None)
    _ffi.LOADER.loaded[CPU] = str(_ffi.LOADER.package / "_jaxcomp_cpu.so")
    return ffi


def test_no_gpu_with_the_cuda_module_installed(cpu_only):
    path = "/site/jaxcomp/_jaxcomp_cuda.so"
    cpu_only.setattr(_ffi.LOADER, "module", lambda module: object())
    _ffi.LOADER.loaded[CUDA] = path
    line = _ffi.kernels_line()
    assert line.startswith(
        f"CPU kernels avx2; no CUDA GPU visible to JAX (its devices: {PLATFORMS})"
    )
    assert f"the CUDA module is installed ({path}) but has no GPU to run on" in line
    assert "not built" not in line
    assert _ffi.why_not_loaded(CUDA).startswith("not loaded: no CUDA GPU visible to JAX")


def test_no_gpu_and_no_cuda_module(cpu_only):
    _ffi.LOADER.why_not[CUDA] = "not built: this jaxcomp has none"
    line = _ffi.kernels_line()
    assert "no CUDA GPU visible to JAX" in line
    assert line.endswith("no CUDA module is built either (it is built where nvcc is found)")


def test_no_gpu_and_a_cuda_module_of_other_sources(cpu_only):
    _ffi.LOADER.why_not[CUDA] = "the installed build (/x) was compiled from other kernel sources"
    line = _ffi.kernels_line()
    assert "no CUDA GPU visible to JAX" in line
    assert line.endswith(
        "CUDA module: the installed build (/x) was compiled from other kernel sources"
    )


def test_no_gpu_names_jax_platforms(cpu_only):
    cpu_only.setenv("JAX_PLATFORMS", "cpu")
    want = f"no CUDA GPU visible to JAX (its devices: {PLATFORMS}; JAX_PLATFORMS=cpu)"
    assert want in _ffi.kernels_line()


def test_a_gpu_without_the_cuda_kernels(cpu_only):
    gpu = types.SimpleNamespace(device_kind="NVIDIA H100")
    cpu_only.setattr(_ffi.LOADER, "cuda_gpus", lambda: [gpu])
    cpu_only.setattr(_ffi.LOADER, "cuda_available", lambda: False)
    _ffi.LOADER.why_not[CUDA] = "not built: none here"
    assert _ffi.kernels_line() == (
        "CPU kernels avx2; CUDA kernels not loaded on the NVIDIA H100: not built: none here"
    )
    cpu_only.setattr(_ffi.LOADER, "cuda_available", lambda: True)
    _ffi.LOADER.loaded[CUDA] = str(_ffi.LOADER.package / "_jaxcomp_cuda.so")
    assert _ffi.kernels_line() == "CPU kernels avx2; CUDA kernels on NVIDIA H100"


def test_cpu_kernels_of_other_sources(cpu_only):
    cpu_only.setattr(_ffi.LOADER, "cpu_available", lambda: False)
    _ffi.LOADER.why_not[CPU] = "the installed build (/x) was compiled from other kernel sources"
    _ffi.LOADER.why_not[CUDA] = "not built: ..."
    assert _ffi.kernels_line().startswith(
        "CPU kernels not loaded: the installed build (/x) was compiled from other kernel sources; "
    )


def test_backend_ffi_without_kernels_says_why(cpu_only):
    cpu_only.setattr(_dispatch, "cpu_available", lambda: False)
    cpu_only.setattr(_dispatch, "cuda_available", lambda: False)
    cpu_only.setattr(_ffi.LOADER, "cpu_available", lambda: False)
    _ffi.LOADER.why_not[CPU] = "the installed build (/x) was compiled from other kernel sources"
    _ffi.LOADER.why_not[CUDA] = "not built: ..."
    with pytest.raises(RuntimeError) as e:
        jc.codecs.QSGD().encode(jnp.ones(64), jax.random.key(0), backend="ffi")
    msg = str(e.value)
    assert msg.startswith(
        "backend='ffi' but no jaxcomp kernels are loaded: CPU kernels not loaded: the "
        "installed build (/x) was compiled from other kernel sources"
    )
    assert msg.endswith("backend='xla' or 'auto' runs the pure-JAX twins instead")
    assert "not built: ..." not in msg  # no GPU: the CUDA module's state is the short one


# ---------------------------------------------------------------------------
# jc.codecs.get: unknown names and parameters
# ---------------------------------------------------------------------------
_QSGD_PARAMS = (
    "its parameters are bits, bucket_size, norm, as in 'qsgd:bits=4,bucket_size=512,norm=max'"
)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (
            ("qsgd:bit=4",),
            {},
            r"QSGD \('qsgd'\) has no parameter 'bit' in 'qsgd:bit=4' \(did you mean 'bits'\?\); ",
        ),
        (
            ("qsgd",),
            {"bit": 4},
            r"QSGD \('qsgd'\) has no parameter 'bit' \(did you mean 'bits'\?\); ",
        ),
        (
            ("qsgd:bits=4",),
            {"Norm": "max"},
            r"QSGD \('qsgd'\) has no parameter 'Norm' \(did you mean 'norm'\?\)",
        ),
        (
            (jc.codecs.QSGD,),
            {"bit": 4},
            r"QSGD \('qsgd'\) has no parameter 'bit' \(did you mean 'bits'\?\)",
        ),
        (
            (jc.codecs.QSGD(),),
            {"bucketsize": 8},
            r"QSGD \('qsgd'\) has no parameter 'bucketsize' \(did you mean 'bucket_size'\?\)",
        ),
    ],
    ids=["spec", "keyword", "keyword-after-spec", "class", "codec"],
)
def test_an_unknown_parameter_names_the_codec_the_key_and_the_parameters(args, kwargs, match):
    with pytest.raises(TypeError, match=rf"^jc\.codecs\.get: {match}") as e:
        jc.codecs.get(*args, **kwargs)
    assert str(e.value).endswith(_QSGD_PARAMS)


def test_an_unknown_parameter_of_an_alias_or_a_nested_codec():
    with pytest.raises(
        TypeError,
        match=r"Cast \('cast'\) has no parameter 'dtyp' in 'bf16:dtyp=float16' \(did you mean 'dtype'\?\); its parameters are dtype",
    ):
        jc.codecs.get("bf16:dtyp=float16")
    with pytest.raises(
        TypeError,
        match=r"QSGD \('qsgd'\) has no parameter 'bitz' in 'qsgd:bitz=8' \(did you mean 'bits'\?\)",
    ):
        jc.codecs.get("topk:fraction=0.01,value_codec=(qsgd:bitz=8)")


def test_an_unknown_parameter_without_a_close_one():
    with pytest.raises(TypeError) as e:
        jc.codecs.get("qsgd:zzz=1")
    assert "did you mean" not in str(e.value)
    assert str(e.value).endswith(_QSGD_PARAMS)
    with pytest.raises(
        TypeError,
        match=r"^jc\.codecs\.get: Identity \('identity'\) takes no parameters; got 'x' in 'identity:x=1'$",
    ):
        jc.codecs.get("identity:x=1")


@pytest.mark.parametrize(
    "name, hint",
    [("qsgdd", " (did you mean 'qsgd'?)"), ("1bitt", " (did you mean '1bit'?)"), ("zzz", "")],
)
def test_an_unknown_codec_lists_the_names_and_suggests_one(name, hint):
    with pytest.raises(ValueError) as e:
        jc.codecs.get(f"{name}:bits=4")
    msg = str(e.value)
    assert msg.startswith(
        f"jc.codecs.get: unknown codec '{name}'{hint}; known: {', '.join(jc.codecs.names())} (aliases: "
    )
    assert msg.endswith("parameters go after a colon: 'qsgd:bits=4'")


# ---------------------------------------------------------------------------
# onebit_adam's warm-up
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("factory", [jc.optax.onebit_adam, jc.optax.scale_by_onebit_adam])
def test_onebit_adam_without_warmup_steps_says_what_it_is(factory):
    args = (1e-3, "data") if factory is jc.optax.onebit_adam else ("data",)
    with pytest.raises(
        TypeError,
        match=r"^jc\.optax\.onebit_adam: warmup_steps is required: the number of steps of plain Adam",
    ) as e:
        factory(*args)
    msg = str(e.value)
    assert "15-25% of training" in msg and "warmup_steps=2000 for 10000 steps" in msg
    assert "freeze_tolerance" in msg


@pytest.mark.parametrize("value", [0.2, 1000.0, True])
def test_onebit_adam_warmup_steps_is_a_number_of_steps(value):
    with pytest.raises(
        ValueError,
        match=rf"^jc\.optax\.onebit_adam: warmup_steps must be an int \(a number of steps\), got {value!r}; for a fraction of the run write int\(fraction \* total_steps\)",
    ):
        jc.optax.onebit_adam(1e-3, "data", warmup_steps=value)
