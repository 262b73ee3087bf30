"""jc.optax.uncompressed_mean, the uncompressed baseline, and jc.data_parallel's refusal
of a chain that does not all-reduce the gradients.

The baseline is the hand-written lax.pmean step, bit for bit, with
parameters identical on every device; its telemetry reports the gradients'
own width and the bytes of a ring all-reduce. A chain without an
all-reduce (optax.adam alone, or hidden in a wrapper) raises at the first
step instead of training a different model on every device; every
all-reduce jaxcomp offers, in every optax wrapper, passes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import auto_mesh, mlp_loss
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")


def _problem(dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (32, 64)) / 32**0.5,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 1)) / 8,
    }
    x = jax.random.normal(k3, (128, 32))
    return jax.tree.map(lambda a: a.astype(dtype), params), (x.astype(dtype), jnp.sin(x[:, :1]))


def _hand_written_pmean_step(tx_after, mesh, axes):
    """A shard_map step written by hand: value_and_grad, lax.pmean, tx_after."""

    def local(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        grads = jax.lax.pmean(grads, axes)
        updates, opt_state = tx_after.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axes)

    spec = P(axes)
    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), (spec, spec)),
            out_specs=(P(), P(), P()),
            check_vma=False,  # as in docs/training-loop.md
        )
    )


def _replicas_equal(tree):
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 8
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])


@pytest.mark.parametrize(
    "shape, axes", [((8,), "data"), ((2, 4), ("slow", "fast"))], ids=["flat", "hierarchical"]
)
def test_baseline_is_the_hand_written_pmean_step_bit_for_bit(shape, axes):
    mesh = auto_mesh(shape, (axes,) if isinstance(axes, str) else axes)
    params0, batch = _problem()
    step = jc.data_parallel(
        mlp_loss, optax.chain(jc.optax.uncompressed_mean(axes), optax.adam(1e-2)), mesh, axes
    )
    params, opt_state = step.init(params0)
    batch = step.shard_batch(batch)
    hand = _hand_written_pmean_step(optax.adam(1e-2), mesh, axes)
    p2, s2 = jax.tree.map(jnp.copy, params), optax.adam(1e-2).init(params0)
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state, batch)
        p2, s2, loss2 = hand(p2, s2, batch)
    assert float(loss) < float(mlp_loss(params0, batch))  # it trains
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(loss2))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _replicas_equal(params)
    assert int(jc.optax.telemetry(opt_state)["step"]) == 5


@pytest.mark.parametrize(
    "dtype, bits", [(jnp.float32, 32.0), (jnp.bfloat16, 16.0)], ids=["float32", "bfloat16"]
)
def test_baseline_telemetry_reports_the_uncompressed_all_reduce(dtype, bits):
    mesh = auto_mesh()
    params0, batch = _problem(dtype)
    tx = optax.chain(jc.optax.uncompressed_mean("data"), optax.sgd(0.1))
    opt_state = jc.optax.init(tx, params0, mesh, "data")
    specs = jc.optax.state_specs(opt_state, "data")
    assert all(s == P() for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
    before = float(jc.optax.telemetry(opt_state)["wire_bytes"])  # the first step's, before it
    step = jc.data_parallel(mlp_loss, tx, mesh)
    params, opt_state = step.init(params0)
    params, opt_state, _ = step(params, opt_state, batch)
    stats = jc.optax.telemetry(opt_state)
    n = sum(p.size for p in jax.tree.leaves(params0))
    itemsize = jnp.dtype(dtype).itemsize
    assert float(stats["bits_per_element"]) == bits
    # A ring all-reduce: each device sends 2 (P-1)/P of the gradient bytes.
    np.testing.assert_allclose(float(stats["wire_bytes"]), 2 * 7 / 8 * n * itemsize, rtol=1e-6)
    assert float(stats["wire_bytes"]) == before
    np.testing.assert_allclose(float(stats["compression_ratio"]), 4 / itemsize, rtol=1e-6)
    assert float(stats["residual_norm"]) == 0 and int(stats["skipped_steps"]) == 0


def test_data_parallel_refuses_a_chain_without_all_reduce():
    mesh = auto_mesh()
    params0, batch = _problem()
    step = jc.data_parallel(mlp_loss, optax.adam(1e-3), mesh)
    params, opt_state = step.init(params0)
    with pytest.raises(
        ValueError, match=r"^jc\.data_parallel: the optimizer does not average"
    ) as e:
        step(params, opt_state, batch)
    assert "jc.optax.uncompressed_mean('data')" in str(e.value)
    assert "jc.optax.compress_gradients(codec, 'data')" in str(e.value)


@pytest.mark.parametrize(
    "tx",
    [
        optax.adam(1e-3),
        optax.chain(jc.optax.compress_gradients("qsgd:bits=4", "data"), optax.sgd(0.1)),
    ],
    ids=["adam", "qsgd"],
)
def test_a_one_device_mesh_needs_no_all_reduce(tx):
    """One device (a one-GPU machine): nothing to average, so no chain is
    refused, and a compressed chain runs though its all-reduce moves nothing."""
    mesh = jax.make_mesh(
        (1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,)
    )
    params0, batch = _problem()
    step = jc.data_parallel(mlp_loss, tx, mesh)
    params, opt_state = step.init(params0)
    params, opt_state, loss = step(params, opt_state, batch)
    assert np.isfinite(float(loss))


def _one_leaf_unreduced():
    return optax.multi_transform(
        {
            "reduced": optax.chain(jc.optax.uncompressed_mean("data"), optax.sgd(0.1)),
            "plain": optax.sgd(0.1),
        },
        {"w1": "reduced", "b1": "reduced", "w2": "plain"},
    )


@pytest.mark.parametrize(
    "make_tx, leaf",
    [
        (lambda: optax.MultiSteps(optax.adam(1e-3), 2), "updates['b1']"),
        (_one_leaf_unreduced, "updates['w2']"),
    ],
    ids=["multisteps_adam", "one_leaf_unreduced"],
)
def test_a_missing_all_reduce_is_found_inside_wrappers(make_tx, leaf):
    mesh = auto_mesh()
    params0, batch = _problem()
    step = jc.data_parallel(mlp_loss, make_tx(), mesh)
    params, opt_state = step.init(params0)
    with pytest.raises(ValueError, match="does not average the gradients") as e:
        step(params, opt_state, batch)
    assert f": {leaf} depends on this device's gradient" in str(e.value)


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.chain(jc.optax.compress_gradients("int8", "data"), optax.adam(1e-3)),
        lambda: optax.chain(
            jc.optax.compress_gradients("onebit", "data", algorithm="ring", min_compress_size=0),
            optax.sgd(0.1),
        ),
        lambda: jc.optax.onebit_adam(1e-3, "data", warmup_steps=1),
        lambda: optax.chain(jc.optax.powersgd("data", rank=2), optax.sgd(0.1)),
        lambda: optax.MultiSteps(
            optax.chain(jc.optax.uncompressed_mean("data"), optax.adam(1e-3)), 2
        ),
        lambda: optax.inject_hyperparams(
            lambda learning_rate: optax.chain(
                jc.optax.uncompressed_mean("data"), optax.sgd(learning_rate)
            )
        )(learning_rate=0.1),
    ],
    ids=["compress", "compress_ring", "onebit_adam", "powersgd", "multisteps", "inject"],
)
def test_every_all_reduce_passes_and_keeps_the_replicas_equal(make_tx):
    mesh = auto_mesh()
    params0, batch = _problem()
    step = jc.data_parallel(mlp_loss, make_tx(), mesh)
    params, opt_state = step.init(params0)
    for _ in range(2):  # onebit_adam's second step is compressed
        params, opt_state, loss = step(params, opt_state, batch)
    assert np.isfinite(float(loss))
    _replicas_equal(params)


def test_baseline_misuse_raises():
    with pytest.raises(ValueError, match=r"^jc\.optax\.uncompressed_mean: axis_name must be"):
        jc.optax.uncompressed_mean(("a", "b", "c"))
    tx = jc.optax.uncompressed_mean("data")
    grads = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"^jc\.optax\.uncompressed_mean: update must run inside"):
        tx.update(grads, tx.init(grads))
    # Adam before the all-reduce would keep each device's moments.
    with pytest.raises(ValueError, match="before the compressed all-reduce"):
        jc.optax.init(optax.chain(optax.adam(1e-3), tx), grads, auto_mesh(), "data")


def test_the_old_name_is_deprecated():
    """jc.optax.pmean (the transformation) shared its name with jc.pmean
    (the collective): it warns and names uncompressed_mean."""
    with pytest.warns(DeprecationWarning, match=r"jc\.optax\.uncompressed_mean"):
        tx = jc.optax.pmean("data")
    assert isinstance(tx.init({"w": jnp.zeros(3)}), jc.optax.PmeanState)
