"""One order of collectives on every device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.ops import platform_dependent


def after(x, dep):
    """``x`` (a pytree of arrays), made to wait for ``dep`` (a pytree) on
    XLA:CPU.

    XLA:CPU's thunk executor runs independent operations in whatever order
    they become ready, device by device, handing some to a small thread
    pool. Two independent chains of collectives (two buckets' all-reduces,
    one with its collectives nested in a conditional: the capacity tiers of
    ``transfer``) can then be entered in different orders by different
    devices, each waiting in a rendezvous its peers do not reach while the
    pool's threads are taken: XLA aborts the process after its rendezvous
    timeout (docs/training.md says when it was seen). A data dependency from
    the previous chain's outputs gives every device the same order.
    ``lax.optimization_barrier`` does not serve: XLA:CPU removes it after
    scheduling, and its thunk executor follows data dependencies, not the
    schedule. So every element of ``x`` gets ``-0.0`` added (the identity,
    bit for bit, for every float), a ``-0.0`` computed from a bit of each
    leaf of ``dep`` that XLA cannot fold away (integers get 0); it fuses
    into whatever computes ``x``. Other platforms issue collectives in
    program order, and keep the freedom to overlap chains.

    The platform choice below (one primitive lowered per platform, as the
    kernel calls are: a program lowered for the CPU holds the tie alone)
    is the one outside :mod:`jaxcomp.ops`, on purpose: it chooses no
    kernel, it works around one platform's executor, and belongs with the
    collectives it orders.
    """
    deps = [d for d in map(jnp.asarray, jax.tree.leaves(dep)) if d.size]
    if not deps:
        return x

    def tie(x, *deps):
        # popcount of 32 bits >> 6 is 0: -0.0's bits, from data at run time.
        count = sum(
            lax.population_count(
                lax.bitcast_convert_type(d.reshape(-1)[0].astype(jnp.float32), jnp.uint32)
            )
            for d in deps
        )
        zero = lax.bitcast_convert_type(jnp.uint32(0x80000000) | (count >> 6), jnp.float32)
        return jax.tree.map(lambda a: a + zero.astype(a.dtype), x)

    return platform_dependent(x, *deps, cpu=tie, default=lambda x, *deps: x)
