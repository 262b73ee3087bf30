"""One function per FFI target, each with its pure-JAX twin (``*_ref``).

Platform dispatch lives in :mod:`jaxcomp.ops._dispatch` and only there.
"""

from jaxcomp.ops import cast, int8, natural, onebit, packing, qsgd, rng, ternary, terngrad

__all__ = ["cast", "int8", "natural", "onebit", "packing", "qsgd", "rng", "ternary", "terngrad"]
