"""Building blocks shared by the codecs' pure-JAX twins, and the dispatch
between FFI kernels and twins.

Each codec's kernel calls and twins live in its own module of
:mod:`jaxcomp.codecs`; what several of them share is here: the
counter-based random bits (:mod:`~jaxcomp.ops.rng`), bit packing
(:mod:`~jaxcomp.ops.packing`), base-3^5 packing (:mod:`~jaxcomp.ops.ternary`)
and the bucket helpers (:mod:`~jaxcomp.ops.bucket`). Platform dispatch lives in
:mod:`jaxcomp.ops._dispatch` and only there; the layers above call it as
``dispatch``, ``ffi_call`` and ``platform_dependent``.
"""

from jaxcomp.ops import bucket, packing, rng, ternary
from jaxcomp.ops._dispatch import dispatch, ffi_call, platform_dependent

__all__ = ["bucket", "dispatch", "ffi_call", "packing", "platform_dependent", "rng", "ternary"]
