"""``jc.data_parallel`` never changes a layout silently: sharded parameters
are refused with an error that says what to do, and the RNG streams an NNX
module holds (``nnx.Dropout``'s) draw differently on every device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

N = 8


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:N]), ("data",))


def _tx():
    return optax.chain(jc.optax.compress_gradients("int8", "data"), optax.sgd(0.1))


def _loss(params, batch):
    return jnp.mean((batch @ params["w"]) ** 2)


def test_sharded_parameters_are_refused_at_init(mesh):
    w = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data")))
    step = jc.data_parallel(_loss, _tx(), mesh)
    with pytest.raises(ValueError, match=r"\[.w.\] sharded.*shard_params=.*device_put"):
        step.init({"w": w})


def test_sharded_parameters_are_refused_by_the_step(mesh):
    step = jc.data_parallel(_loss, _tx(), mesh)
    params, opt_state = step.init({"w": jnp.ones((16, 4))})
    assert params["w"].sharding.is_fully_replicated
    sharded = {"w": jax.device_put(params["w"], NamedSharding(mesh, P("data")))}
    with pytest.raises(ValueError, match="sharded over the devices"):
        step(sharded, opt_state, jnp.ones((N, 16)))


def test_replicated_and_host_parameters_are_taken(mesh):
    step = jc.data_parallel(_loss, _tx(), mesh)
    for w in (np.ones((16, 4), np.float32), jax.device_put(jnp.ones((16, 4)), step.replicated)):
        params, opt_state = step.init({"w": w})
        params, opt_state, loss = step(params, opt_state, jnp.ones((N, 16)))
        assert np.isfinite(float(loss))


def test_sharded_nnx_module_is_refused(mesh):
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    model.kernel.set_value(jax.device_put(model.kernel[...], NamedSharding(mesh, P(None, "data"))))
    step = jc.data_parallel(lambda m, b: jnp.mean(m(b) ** 2), _tx(), mesh)
    with pytest.raises(ValueError, match=r"kernel.*sharded"):
        step.init(model)


def test_module_held_dropout_draws_a_mask_per_device(mesh):
    """Every device sees the same batch; the loss returns how many devices
    kept each element (integer aux is summed over the devices). With one
    mask for all, every count would be 0 or 8."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.scale = nnx.Param(jnp.ones((256,)))
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(x * self.scale)

    def loss(model, batch):
        y = model(batch)
        return jnp.mean(y**2), jnp.sum(y[:1] != 0, axis=0).astype(jnp.int32)

    model = Model(nnx.Rngs(0, dropout=1))
    key0 = np.asarray(jax.random.key_data(model.drop.rngs.key[...]))
    step = jc.data_parallel(loss, _tx(), mesh, has_aux=True)
    params, opt_state = step.init(model)
    batch = jnp.ones((N, 256))
    params, opt_state, (_, kept) = step(params, opt_state, batch)
    kept = np.asarray(kept)
    assert kept.shape == (256,)
    assert np.mean((kept > 0) & (kept < N)) > 0.5  # masks differ across devices
    assert 0.3 < kept.mean() / N < 0.7  # each device keeps about half
    # The module's key is kept; its counter moves on, so the next step draws anew.
    params, opt_state, (_, kept2) = step(params, opt_state, batch)
    assert not np.array_equal(kept, np.asarray(kept2))
    rngs = step.module(params).drop.rngs
    np.testing.assert_array_equal(jax.random.key_data(rngs.key[...]), key0)
    assert int(rngs.count[...]) == 2
