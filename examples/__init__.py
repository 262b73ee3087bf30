"""Flax examples of data-parallel training with compressed gradients.

Run them from the repository root, e.g. ``python -m examples.image_classifier.main``
(they are not part of the installed ``jaxcomp`` package).
"""
