"""Telemetry's static figures (bits per element, wire bytes, compression
ratio) are in the state from its creation on the mesh: before the first
step they are what that step sends, for every transformation that reports
them, under jc.data_parallel and jax.pmap alike."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import auto_mesh, mlp_loss

import jaxcomp as jc

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")

STATIC = ("bits_per_element", "wire_bytes", "compression_ratio")


def _problem():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (32, 64)) / 32**0.5,  # compressed (2048 elements)
        "b1": jnp.zeros(64),  # sent exactly
        "w2": jax.random.normal(k2, (64, 1)) / 8,
    }
    x = jax.random.normal(k3, (128, 32))
    return params, (x, jnp.sin(x[:, :1]))


def _static(opt_state) -> dict[str, float]:
    t = jc.optax.telemetry(opt_state)
    return {k: float(np.asarray(t[k]).reshape(-1)[0]) for k in STATIC}


# One of each way a state is made (the warm-up flag of compress_gradients:
# test_warmup_figures_...; onebit_adam's compress state is compress_gradients').
TRANSFORMS = {
    "qsgd-two_phase": lambda: jc.optax.compress_gradients("qsgd:bits=4", "data"),
    "pmean": lambda: jc.optax.uncompressed_mean("data"),
    "powersgd": lambda: jc.optax.powersgd("data", rank=2, min_compression_rate=1.0),
    "powersgd-warmup": lambda: jc.optax.powersgd("data", rank=2, warmup_steps=1),
    "diloco": lambda: jc.optax.diloco(optax.sgd(0.1), "data", sync_every=2, codec="int8"),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_first_step_figures_are_in_the_new_state(name):
    first = TRANSFORMS[name]()
    tx = first if name == "diloco" else optax.chain(first, optax.sgd(0.1))
    params, batch = _problem()
    step = jc.data_parallel(mlp_loss, tx, auto_mesh())
    params, opt_state = step.init(params)
    before = _static(opt_state)
    assert before["bits_per_element"] > 0 and before["wire_bytes"] > 0, before
    params, opt_state, _ = step(params, opt_state, batch)
    assert _static(opt_state) == before
    assert int(jc.optax.telemetry(opt_state)["step"]) == 1


def test_warmup_figures_come_first_then_the_compressed_ones():
    params, batch = _problem()
    tx = optax.chain(jc.optax.compress_gradients("onebit", "data", warmup_steps=1), optax.sgd(0.1))
    step = jc.data_parallel(mlp_loss, tx, auto_mesh())
    params, opt_state = step.init(params)
    before = _static(opt_state)
    assert before["bits_per_element"] == 32.0  # the exact mean of float32 gradients
    for _ in range(2):  # the warm-up step, then a compressed one
        params, opt_state, _ = step(params, opt_state, batch)
    assert _static(opt_state)["bits_per_element"] < 8.0


def test_pmap_init_has_the_figures_and_a_plain_init_outside_the_mesh_has_zeros():
    params, _ = _problem()
    tx = optax.chain(jc.optax.compress_gradients("qsgd:bits=4", "data"), optax.sgd(0.1))
    n = jax.device_count()
    replicated = jax.tree.map(lambda a: jnp.stack([a] * n), params)
    on_mesh = _static(jc.optax.init(tx, params, auto_mesh(), "data"))
    assert on_mesh["wire_bytes"] > 0
    assert _static(jax.pmap(tx.init, axis_name="data")(replicated)) == on_mesh
    # Outside the mesh the number of devices, hence the bytes, is unknown.
    assert _static(tx.init(params)) == dict.fromkeys(STATIC, 0.0)
