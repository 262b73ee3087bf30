"""1-bit Adam's floor under the frozen variance: a parameter whose gradient
was zero during the warm-up (an attention key bias, which the softmax
ignores; an embedding row no batch touched) stays bounded after the
freeze, where dividing the codec's noise by its near-zero variance ran it
away."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

N, AXIS, LR, WARM, STEPS = 8, "data", 1e-3, 20, 100
PARAMS = {"w": jnp.zeros((2048,)), "key_bias": jnp.zeros((64,)), "emb": jnp.zeros((32, 16))}


def grads(t, d):
    """Device d's gradient at step t: ``w`` and the first 16 embedding rows
    random; the key bias exactly zero; rows 16-23 zero during the warm-up
    and random after it; rows 24-31 never touched."""
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.fold_in(jax.random.key(0), t), d))
    e = jax.random.normal(k2, (32, 16))
    late = jnp.where(t < WARM, 0.0, 1.0)
    e = jnp.concatenate([e[:16], e[16:24] * late, jnp.zeros((8, 16))])
    return {"w": jax.random.normal(k1, (2048,)) + 0.3, "key_bias": jnp.zeros((64,)), "emb": e}


@functools.cache
def train(variance_floor="default"):
    """The parameters after STEPS steps of onebit_adam (with its default
    floor, or ``variance_floor``; for None, Adam on the exact mean) on 8
    devices."""
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    if variance_floor is None:
        tx = optax.chain(jc.optax.uncompressed_mean(AXIS), optax.adam(LR))
    else:
        kw = {} if variance_floor == "default" else {"variance_floor": variance_floor}
        tx = jc.optax.onebit_adam(LR, AXIS, warmup_steps=WARM, **kw)
    state = jc.optax.init(tx, PARAMS, mesh, AXIS)
    specs = jc.optax.state_specs(state, AXIS)

    def body(state, params):
        d = lax.axis_index(AXIS)

        def one(carry, t):
            state, p = carry
            u, state = tx.update(grads(t, d), state, p)
            return (state, optax.apply_updates(p, u)), None

        return lax.scan(one, (state, params), jnp.arange(STEPS))[0]

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(specs, P()), out_specs=(specs, P()), check_vma=False
    )
    _, params = jax.jit(f)(state, PARAMS)
    return {k: np.asarray(v) for k, v in params.items()}


def test_a_parameter_without_gradient_stays_put():
    """Adam leaves it exactly where it was; 1-bit Adam moves it by a small
    fraction of lr x steps (error feedback cancels the codec's noise), not
    by noise / eps per step."""
    assert not train(None)["key_bias"].any()
    moved = np.abs(train()["key_bias"]).max()
    assert moved < 0.1 * LR * STEPS


def test_embedding_rows_untouched_in_the_warm_up_stay_bounded():
    p, adam = train(), train(None)
    # Touched only after the freeze: they train (their gradient is real), by
    # at most about 1 / sqrt(variance_floor) = 10 times lr per step (0.28
    # here, where the paper's rule gives 7e5).
    late = np.abs(p["emb"][16:24])
    assert 0 < late.max() < 10 * LR * STEPS
    assert np.abs(adam["emb"][16:24]).max() > 0
    # Never touched: like the key bias.
    assert np.abs(p["emb"][24:]).max() < 0.1 * LR * STEPS
    # The rows and the leaf that had gradients train as before.
    for k, rows in (("emb", slice(0, 16)), ("w", slice(None))):
        np.testing.assert_allclose(
            np.sqrt(np.mean(p[k][rows] ** 2)), np.sqrt(np.mean(adam[k][rows] ** 2)), rtol=0.1
        )


def test_without_the_floor_the_parameter_runs_away():
    """The paper's rule (variance_floor=0) on the same run: what the floor
    prevents."""
    p = train(0.0)
    assert np.abs(p["key_bias"]).max() > LR * STEPS
    assert np.abs(p["emb"][16:24]).max() > 100 * LR * STEPS


def test_the_floor_leaves_a_warm_up_variance_above_it():
    """Each element at least 1% of its leaf's mean; a leaf with no variance
    of its own (all zero), 1% of the mean over all the parameters."""
    nu = {"a": jnp.array([1.0, 1e-3, 0.0, 2.0]), "b": jnp.zeros((3,)), "c": jnp.full((1,), 1e-5)}
    floored = jc.optax._adam.floored_variance(nu, 1e-2)
    mean_a = 3.001 / 4
    np.testing.assert_allclose(floored["a"], [1.0, 1e-2 * mean_a, 1e-2 * mean_a, 2.0], rtol=1e-6)
    np.testing.assert_allclose(floored["b"], [1e-2 * (3.001 + 1e-5) / 8] * 3, rtol=1e-6)
    np.testing.assert_allclose(floored["c"], [1e-5], rtol=1e-6)  # small, but its own


def test_bad_variance_floor():
    with pytest.raises(ValueError, match="variance_floor"):
        jc.optax.onebit_adam(LR, AXIS, warmup_steps=WARM, variance_floor=1.5)
