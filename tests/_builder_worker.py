"""One process of the multi-process jc.data_parallel test
(tests/test_train_builder_multiprocess.py).

    python tests/_builder_worker.py PORT NUM_PROCESSES PROCESS_ID LOCAL_DEVICES CKPT_DIR OUT.npz

Joins a jax.distributed job on loopback (gloo CPU collectives, LOCAL_DEVICES
CPU devices per process) and trains the NNX digits CNN of
examples/image_classifier/nnx_main.py with jc.data_parallel, each process
handing in its rows of every global batch: STEPS steps straight through;
the same steps through a shard_map step written by hand (bit for bit
equal); and STEPS // 2 steps, an orbax checkpoint (every process writing
its shards), a restore into fresh arrays and the rest (bit for bit equal to
the straight run). Then a model scanned over its layers, sent from inside
the reverse scan, against the post-backward step (bit for bit); and
jc.optax.diloco through jc.data_parallel (a linear
model, int8 pseudo-gradients every 2 steps: the parameters one copy per
device, across the processes). Saves the losses, the final parameters and
DiLoCo's anchor.
"""

import sys

import jax
import numpy as np

STEPS = 16


def assert_same(*trees) -> None:
    """(params, opt_state) of one run equal to another's on this process's shards."""
    half = len(trees) // 2
    pairs = zip(jax.tree.leaves(trees[:half]), jax.tree.leaves(trees[half:]), strict=True)
    for a, b in pairs:
        for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
            np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data))


def diloco_anchor(mesh, local) -> np.ndarray:
    """DiLoCo's anchor after 5 steps of jc.data_parallel on ``mesh`` (a
    linear model, int8 pseudo-gradients every 2 steps), each process handing
    in ``local(rows)`` of every global batch. tests/test_train_builder_multiprocess.py
    runs it in one process too."""
    import jax.numpy as jnp
    import optax

    import jaxcomp as jc

    def loss(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] - y) ** 2)

    tx = jc.optax.diloco(optax.sgd(0.05), "data", sync_every=2, codec="int8")
    step = jc.data_parallel(loss, tx, mesh)
    params, state = step.init({"w": jnp.zeros((8, 2))})
    for i in range(5):
        x = np.random.default_rng(i).normal(size=(4 * mesh.size, 8)).astype(np.float32)
        batch = (x, np.tanh(x[:, :2]))
        params, state, _ = step(params, state, step.shard_batch(tuple(map(local, batch))))
    return np.asarray(state.anchor["w"].addressable_shards[0].data)


def scanned_model_agrees(mesh, local) -> None:
    """A model scanned over its layers, each layer's gradient sent from
    inside the reverse scan (``compress_gradients(layers=)``), equals the
    post-backward step bit for bit after 3 steps, each process handing in
    ``local(rows)`` of every global batch."""
    import jax.numpy as jnp
    import optax

    import jaxcomp as jc

    def loss(p, batch):
        x, y = batch

        def layer(h, w):
            return jnp.tanh(h @ jc.fsdp.gather(w)), None

        return jnp.mean((jax.lax.scan(layer, x, p["layers"])[0] - y) ** 2)

    params = {"layers": jax.random.normal(jax.random.key(0), (3, 32, 32)) / 6}
    runs = []
    for overlap in (True, False):
        tx = optax.chain(
            jc.optax.compress_gradients("qsgd:bits=4", "data", layers=lambda *_: True),
            optax.sgd(0.1),
        )
        step = jc.data_parallel(loss, tx, mesh, overlap=overlap)
        p, s = step.init(params)
        for i in range(3):
            x = np.random.default_rng(i).normal(size=(4 * mesh.size, 32)).astype(np.float32)
            p, s, _ = step(p, s, step.shard_batch(tuple(map(local, (x, np.tanh(x))))))
        runs.append((p, s))
    assert_same(*runs[0], *runs[1])


def main() -> None:
    port, num, pid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    local_devices, ckpt_dir, out = int(sys.argv[4]), sys.argv[5], sys.argv[6]
    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num, process_id=pid
    )
    import dataclasses

    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from examples.image_classifier import nnx_main
    from examples.image_classifier.configs import default

    ndev = num * local_devices
    assert jax.device_count() == ndev, jax.devices()
    config = dataclasses.replace(default.get_config(), steps=STEPS, num_devices=ndev)
    mesh = jax.make_mesh((ndev,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = config.global_batch_size // num

    def local(batch):  # this process's rows of the global batch
        return tuple(a[pid * rows : (pid + 1) * rows] for a in batch)

    def run(step, params, opt_state, start, stop):
        key = jax.random.key(config.seed)
        losses = []
        for i, batch in nnx_main.batches(config, start):
            if i == stop:
                break
            params, opt_state, (loss, _) = step(
                params, opt_state, step.shard_batch(local(batch)), jax.random.fold_in(key, i)
            )
            losses.append(float(loss))
        return params, opt_state, losses

    # Each bucket sent from inside the backward pass: the hand-written step
    # below sends them after it, and the two must agree bit for bit.
    _, step, params0, state0 = nnx_main.build(
        config, "qsgd:bits=4", mesh, donate=False, overlap=True
    )
    params, opt_state, losses = run(step, params0, state0, 0, STEPS)

    # The hand-written shard_map step (docs/training-loop.md).
    model = nnx_main.CNN(tuple(config.features), config.hidden, rngs=nnx.Rngs(config.seed))
    graphdef, template, rest = nnx.split(model, nnx.Param, ...)
    tx = nnx_main.make_tx(config, "qsgd:bits=4")

    def loss_of_dict(params, batch, key):
        st = jax.tree.map(lambda a: a, template)
        nnx.replace_by_pure_dict(st, params)
        return nnx_main.loss_fn(nnx.merge(graphdef, st, rest), batch, key)

    def local_step(params, opt_state, batch, key):
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))
        (loss, aux), grads = jax.value_and_grad(loss_of_dict, has_aux=True)(params, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        out = jax.lax.pmean((loss, aux), "data")
        return optax.apply_updates(params, updates), opt_state, out

    specs = jc.optax.state_specs(state0, "data")
    hand = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(P(), specs, (P("data"), P("data")), P()),
            out_specs=(P(), specs, P()),
            check_vma=False,
        )
    )

    class Hand:
        shard_batch = step.shard_batch

        def __call__(self, *args):
            return hand(*args)

    p_hand, s_hand, hand_losses = run(Hand(), params0, state0, 0, STEPS)
    assert hand_losses == losses, (hand_losses, losses)
    assert_same(p_hand, s_hand, params, opt_state)

    # Half the steps, a checkpoint, a restore, the other half.
    half = STEPS // 2
    p, s, first = run(step, params0, state0, 0, half)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(f"{ckpt_dir}/ckpt", {"params": p, "opt_state": s})
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        {"params": p, "opt_state": s},
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(f"{ckpt_dir}/ckpt", abstract)
    p, s, second = run(step, restored["params"], restored["opt_state"], half, STEPS)
    assert first + second == losses, (first + second, losses)
    assert_same(p, s, params, opt_state)

    rows_of = lambda a: a[pid * len(a) // num : (pid + 1) * len(a) // num]  # noqa: E731
    scanned_model_agrees(mesh, rows_of)
    anchor = diloco_anchor(mesh, rows_of)
    kernel = np.asarray(params["conv1"]["kernel"].addressable_shards[0].data)
    np.savez(out, losses=np.asarray(losses), kernel=kernel, anchor=anchor)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
