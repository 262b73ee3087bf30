"""A source checkout never shadows the installed kernels: ``import jaxcomp``
from the repository root finds the source tree, which has no compiled
modules; it loads the installed ones where they were built from the same
kernel sources (jaxcomp/_ffi.py), and says why not where they were not."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

import jaxcomp
from jaxcomp import _ffi

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROBE = (
    "import jaxcomp, jaxcomp._ffi as f; "
    "print(jaxcomp.__file__); print(jaxcomp.cpu_available()); print(f.why_not_loaded('_jaxcomp_cpu'))"
)


def _probe(cwd: pathlib.Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


needs_kernels = pytest.mark.skipif(not jaxcomp.cpu_available(), reason="CPU kernels not built")


@needs_kernels
def test_python_from_the_root_runs_the_installed_kernels():
    if not _ffi.LOADER.installed_elsewhere("_jaxcomp_cpu") and _ffi.checkout_root() == ROOT:
        pytest.skip("no installed build beside the checkout (an in-place build?)")
    path, available, _ = _probe(ROOT)
    assert pathlib.Path(path).resolve() == ROOT / "jaxcomp" / "__init__.py"
    assert available == "True"


@needs_kernels
def test_a_checkout_of_other_kernel_sources_gets_none(tmp_path):
    """A checkout whose kernel sources differ from the installed build's
    loads no kernels, and the reason names both."""
    for d in ("jaxcomp", "ffi", "cuda"):
        shutil.copytree(
            ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("*.so", "__pycache__")
        )
    shutil.copy(ROOT / "CMakeLists.txt", tmp_path)
    with open(tmp_path / "ffi" / "module.cc", "a") as f:
        f.write("// changed\n")
    path, available, why = _probe(tmp_path)
    assert pathlib.Path(path).resolve() == tmp_path / "jaxcomp" / "__init__.py"
    assert available == "False"
    assert "other kernel sources" in why and str(tmp_path) in why


def test_the_hash_covers_every_kernel_source(tmp_path):
    for d in ("ffi", "cuda"):
        shutil.copytree(ROOT / d, tmp_path / d)
    before = _ffi.kernel_sources_hash(tmp_path)
    (tmp_path / "cuda" / "new.cu").write_text("// a new family\n")
    assert _ffi.kernel_sources_hash(tmp_path) != before
