"""One process of the multi-process collective test (tests/test_multiprocess.py).

    python tests/_mp_worker.py PORT NUM_PROCESSES PROCESS_ID OUT.npz

Joins a jax.distributed job on loopback (gloo CPU collectives, one CPU device
per process), runs jc.psum for every (codec, algorithm) case on the same
deterministic global input, with a server residual (two-level error
feedback) where the algorithm has one, and saves this process's rows of
value, sent and the new server residual; then a few steps of
jc.optax.onebit_adam across the freeze and of jc.optax.powersgd, saving
this process's updates.
"""

import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# One case per way of moving payloads: an all-reduce of linear payloads,
# an all-gather, an all-to-all + all-gather, a ring of ppermutes, capacity
# tiers (a pmax and a lax.switch over collectives, across processes), and
# both sparse algorithms.
CASES = [
    ("identity", {}, "auto"),  # allreduce
    ("int8", {"bucket_size": 64}, "allgather"),
    ("qsgd", {"bits": 4, "bucket_size": 64}, "two_phase"),
    ("onebit", {}, "ring"),
    ("threelc", {"sparsity": 1.0}, "two_phase"),
    ("topk", {"fraction": 0.01}, "sparse"),  # static sparse all-reduce
    ("topk", {"fraction": 0.4}, "sparse"),  # DSAR_Split_allgather
]
N = 1000


def global_input(num: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((num, N)).astype(np.float32)


def global_state(codec, algorithm, num: int) -> np.ndarray:
    """Every device's server residual, deterministic: [num, state_size]."""
    import jaxcomp as jc

    m = jc.collectives.state_size(codec, N, np.float32, num, algorithm)
    return np.random.default_rng(1).standard_normal((num, m)).astype(np.float32)


def run(mesh, x, codec, algorithm, state):
    """(value, sent, new state) of jc.psum with a server residual."""
    import jaxcomp as jc

    def f(x, st, k):
        r = jc.psum(x[0], "data", codec, key=k, algorithm=algorithm, state=st[0])
        return r.value[None], r.sent[None], r.state[None]

    spec = P("data")
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(spec,) * 3))
    return g(x, state, jax.random.key(7))


ADAM_STEPS, ADAM_WARMUP = 5, 2


def adam_updates(mesh, x):
    """The updates of ``ADAM_STEPS`` steps of jc.optax.onebit_adam (OneBit,
    the variance frozen after ``ADAM_WARMUP``) on device d's gradients
    ``x[d] * (1 + t)``: [devices, steps, N], one row per device."""
    import jax.numpy as jnp
    from jax import lax

    import jaxcomp as jc

    tx = jc.optax.onebit_adam(1e-2, "data", warmup_steps=ADAM_WARMUP)
    params = {"w": np.zeros(N, np.float32)}
    state = jc.optax.init(tx, params, mesh, "data")
    specs = jc.optax.state_specs(state, "data")

    def body(x, state):
        def one(state, t):
            u, state = tx.update({"w": x[0] * (1.0 + t)}, state, params)
            return state, u["w"]

        return lax.scan(one, state, jnp.arange(ADAM_STEPS, dtype=jnp.float32))[1][None]

    # check_vma=False: the mean comes out of all-gathers typed per device (docs/training.md)
    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P("data"), specs), out_specs=P("data"), check_vma=False
    )
    return jax.jit(f)(x, state)


def powersgd_updates(mesh, x):
    """The updates of three steps of jc.optax.powersgd (rank 2) on device
    d's gradients ``x[d]`` viewed as a 40 x 25 matrix times (1 + t):
    [devices, steps, 40, 25], one row per device."""
    import jax.numpy as jnp
    from jax import lax

    import jaxcomp as jc

    tx = jc.optax.powersgd("data", 2)
    params = {"w": np.zeros((40, 25), np.float32)}
    state = jc.optax.init(tx, params, mesh, "data")
    specs = jc.optax.state_specs(state, "data")

    def body(x, state):
        def one(state, t):
            u, state = tx.update({"w": x[0].reshape(40, 25) * (1.0 + t)}, state, params)
            return state, u["w"]

        return lax.scan(one, state, jnp.arange(3, dtype=jnp.float32))[1][None]

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P("data"), specs), out_specs=P("data"), check_vma=False
    )
    return jax.jit(f)(x, state)


def main() -> None:
    port, num, pid, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num, process_id=pid
    )
    import jaxcomp as jc

    mesh = jax.make_mesh((num,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    data = global_input(num)
    sharding = NamedSharding(mesh, P("data"))
    x = jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx])
    results = {}
    for i, (name, params, algorithm) in enumerate(CASES):
        codec = jc.codecs.get(name, **params)
        st = global_state(codec, algorithm, num)
        state = jax.make_array_from_callback(st.shape, sharding, lambda idx, st=st: st[idx])
        outs = run(mesh, x, codec, algorithm, state)
        for what, arr in zip(("value", "sent", "state"), outs, strict=True):
            (mine,) = [np.asarray(s.data) for s in arr.addressable_shards]
            results[f"{what}{i}"] = mine
    (results["adam"],) = [np.asarray(s.data) for s in adam_updates(mesh, x).addressable_shards]
    (results["powersgd"],) = [
        np.asarray(s.data) for s in powersgd_updates(mesh, x).addressable_shards
    ]
    np.savez(out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
