"""Building blocks shared by the codecs' pure-JAX twins, and the dispatch
between FFI kernels and twins.

Each codec's kernel calls and twins live in its own module of
:mod:`jaxcomp.codecs`; what several of them share is here: the
counter-based random bits (:mod:`~jaxcomp.ops.rng`), bit packing
(:mod:`~jaxcomp.ops.packing`), base-3^5 packing (:mod:`~jaxcomp.ops.ternary`)
and the bucket helpers (:mod:`~jaxcomp.ops.bucket`). Platform dispatch lives in
:mod:`jaxcomp.ops._dispatch` and only there.
"""

from jaxcomp.ops import bucket, packing, rng, ternary

__all__ = ["bucket", "packing", "rng", "ternary"]
