"""Flax examples of data-parallel training with compressed gradients.

Run them from the repository root, e.g. ``python -m examples.image_classifier.main``
(they are not part of the installed ``jaxcomp`` package).
"""

import importlib.machinery
import pathlib
import sys


def _prefer_installed_jaxcomp() -> None:
    """Puts the repository root after the installed packages on ``sys.path``.

    ``python -m examples...`` run from the repository root puts the root first
    on ``sys.path``, so ``import jaxcomp`` would find the source tree's
    package, which holds no compiled kernels after a regular (non-editable)
    ``pip install .``, instead of the installed one. An editable install
    resolves to the source tree either way and is left alone.
    """
    if "jaxcomp" in sys.modules:
        return
    root = pathlib.Path(__file__).resolve().parent.parent

    def is_root(entry: str) -> bool:
        try:
            return pathlib.Path(entry or ".").resolve() == root
        except OSError:
            return False

    others = [p for p in sys.path if not is_root(p)]
    spec = importlib.machinery.PathFinder.find_spec("jaxcomp", others)
    if spec is None or spec.origin is None:
        return
    if pathlib.Path(spec.origin).resolve().parent.parent == root:
        return
    sys.path[:] = others + [p for p in sys.path if is_root(p)]


_prefer_installed_jaxcomp()
