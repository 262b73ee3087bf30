"""Compressed all-reduce over a named mesh axis, for use inside
``jax.shard_map`` (or ``jax.pmap``).

Every algorithm is built from ordinary JAX collectives (``all_gather``,
``all_to_all``, ``ppermute``) over encoded payloads, so XLA schedules the
communication and the bytes on the wire can be read from the compiled HLO.
Kernels only ever see this device's data.

``psum`` returns :class:`Reduced`: ``value`` is the (approximate) sum,
identical on every device of the axis, and ``sent`` is what this device's
input became after compression, in float32: summed over the devices, the
``sent`` of every device equals ``value`` up to float rounding, which is what
lets error feedback (``residual = x - sent``) lose nothing. Algorithms that
compress twice can keep their second stage's error in an explicit per-device
``state`` (a server residual: two-level error feedback, see ``psum``).

Each algorithm lives in a file of its own (``_allgather.py``,
``_two_phase.py``, ``_ring.py``, ``_sparse.py``, ``_allreduce.py``,
``_hierarchical.py``) and registers itself by name (:class:`Algorithm`)
when it is imported, as the package does below.

The collectives of sharded training, ``psum_scatter`` and ``all_gather``
(``_scatter.py``), declare their bytes through the same protocol
(:class:`ReduceScatter`, :class:`AllGather`) but are not all-reduce
algorithms and are not registered.
"""

from __future__ import annotations

# Each algorithm registers itself when its module is imported; this order is
# that of ALGORITHMS.
# isort: off
from jaxcomp.collectives import _allgather, _two_phase, _ring, _sparse, _allreduce  # noqa: F401
from jaxcomp.collectives import _hierarchical  # noqa: F401
# isort: on

from jaxcomp.collectives import feedback
from jaxcomp.collectives._algorithm import (
    Algorithm,
    Collective,
    Context,
    KernelCall,
    names,
    registered,
    uncompressed_send_nbytes,
)
from jaxcomp.collectives._allgather import COARSE_ALLGATHER_MAX_DEVICES
from jaxcomp.collectives._api import (
    Reduced,
    all_gather,
    choose_algorithm,
    gather_nbytes,
    init_state,
    operand_nbytes,
    pmean,
    pmean_feedback,
    psum,
    psum_scatter,
    recompression_warning,
    scatter_nbytes,
    send_nbytes,
    state_positions,
    state_size,
)
from jaxcomp.collectives._chunks import chunk_len
from jaxcomp.collectives._exchange import wire_log
from jaxcomp.collectives._order import after
from jaxcomp.collectives._scatter import (
    AllGather,
    ReduceScatter,
    feedback_size,
    psum_scatter_feedback,
)
from jaxcomp.collectives._sparse import static_fits as sparse_is_static
from jaxcomp.collectives._tiers import tier_capacities, tier_nbytes
from jaxcomp.collectives.feedback import all_finite

#: The names ``algorithm=`` takes.
ALGORITHMS = names()

__all__ = [
    "ALGORITHMS",
    "COARSE_ALLGATHER_MAX_DEVICES",
    "Algorithm",
    "AllGather",
    "Collective",
    "Context",
    "KernelCall",
    "ReduceScatter",
    "Reduced",
    "after",
    "all_finite",
    "all_gather",
    "choose_algorithm",
    "chunk_len",
    "feedback",
    "feedback_size",
    "gather_nbytes",
    "init_state",
    "operand_nbytes",
    "pmean",
    "pmean_feedback",
    "psum",
    "psum_scatter",
    "psum_scatter_feedback",
    "recompression_warning",
    "registered",
    "scatter_nbytes",
    "send_nbytes",
    "sparse_is_static",
    "state_positions",
    "state_size",
    "tier_capacities",
    "tier_nbytes",
    "uncompressed_send_nbytes",
    "wire_log",
]
