"""Flax examples of data-parallel training with compressed gradients.

Run them from the repository root, e.g. ``python -m examples.image_classifier.main``
(they are not part of the installed ``jaxcomp`` package). From the root,
``import jaxcomp`` finds the source tree, which loads the compiled kernels of
the installed package where they were built from the same sources
(jaxcomp/_ffi.py).
"""
