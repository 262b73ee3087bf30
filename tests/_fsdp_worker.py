"""One process of the multi-process sharded-training test
(tests/test_fsdp_multiprocess.py).

    python tests/_fsdp_worker.py PORT NUM_PROCESSES PROCESS_ID LOCAL_DEVICES OUT.npz

Joins a jax.distributed job on loopback (gloo CPU collectives, LOCAL_DEVICES
CPU devices per process) and runs :func:`train`: the sharded step with an
Int8 parameter all-gather and a QSGD-4 gradient reduce-scatter under error
feedback, each process handing in its rows of every global batch. Saves
the losses and the whole parameters and residuals.
"""

import sys

import jax
import numpy as np

STEPS = 4


def train(mesh, local):
    """Losses, parameters and residuals (host arrays) after STEPS sharded
    steps on ``mesh``, each process handing in ``local(rows)`` of every
    global batch; tests/test_fsdp_multiprocess.py runs it in one process too."""
    import jax.numpy as jnp
    import optax
    from jax.experimental import multihost_utils

    import jaxcomp as jc

    def loss(p, batch):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (16, 64)) * 0.3,
        "w2": jax.random.normal(k2, (64, 8)) * 0.3,
    }
    cfg = jc.fsdp.ShardParams(
        axis="fsdp", gradients=jc.codecs.QSGD(bits=4), parameters=jc.codecs.Int8()
    )
    step = jc.data_parallel(loss, optax.adam(1e-2), mesh, shard_params=cfg)
    params, state = step.init(params)
    losses = []
    for i in range(STEPS):
        kx, ky = jax.random.split(jax.random.fold_in(k3, i))
        batch = (jax.random.normal(kx, (32, 16)), jax.random.normal(ky, (32, 8)))
        params, state, out = step(params, state, step.shard_batch(tuple(map(local, batch))))
        losses.append(float(out))

    def whole(a):
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return {
        "losses": np.array(losses),
        **{k: whole(v) for k, v in params.items()},
        **{f"r{i}": whole(r) for i, r in enumerate(state.residuals)},
    }


def main() -> None:
    port, num, pid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    local_devices, out = int(sys.argv[4]), sys.argv[5]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num, process_id=pid
    )
    assert jax.local_device_count() == local_devices
    mesh = jax.make_mesh((num * local_devices,), ("fsdp",))
    rows = slice(pid * 32 // num, (pid + 1) * 32 // num)
    np.savez(out, **train(mesh, lambda a: np.asarray(a)[rows]))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
