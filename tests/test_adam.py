"""jc.optax.onebit_adam (1-bit Adam, Tang et al. 2021, Algorithm 1) on
simulated devices: plain Adam during the warm-up, Adam with the variance
frozen after it, conservation of the momentum's error feedback, resume across
the freeze boundary, and the state's layout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

N_DEV = 8
AXIS = "data"
SHAPES = {"a": (40, 50), "b": (300,), "c": (1500,)}  # b: below min_compress_size
LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8


def mesh_of(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def params0():
    return {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}


def grads_at(t, d):
    """Device d's gradient at step t: random, with a per-leaf scale and a
    per-device offset (so the devices' momenta differ)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(7), t), d)
    keys = jax.random.split(key, len(SHAPES))
    return {
        k: jax.random.normal(kk, s) * (1.0 + i) + 0.1 * d
        for i, ((k, s), kk) in enumerate(zip(SHAPES.items(), keys, strict=True))
    }


def run(mesh, tx, steps, state=None, t0=0):
    """``steps`` updates of ``tx`` on every device of ``mesh`` in one scan:
    returns (state, updates stacked over steps, mu before each step)."""
    if state is None:
        state = jc.optax.init(tx, params0(), mesh, AXIS)
    specs = jc.optax.state_specs(state, AXIS)

    def body(state):
        d = lax.axis_index(AXIS)

        def one(state, t):
            mu = _adam_state(state).mu
            u, state = tx.update(grads_at(t, d), state, params0())
            return state, (u, mu)

        return lax.scan(one, state, t0 + jnp.arange(steps))

    f = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(specs, P()), check_vma=False)
    state, (updates, mus) = jax.jit(f)(state)
    return state, updates, mus


def _adam_state(state) -> jc.optax.OneBitAdamState:
    (s,) = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, jc.optax.OneBitAdamState))
        if isinstance(x, jc.optax.OneBitAdamState)
    ]
    return s


def mean_grads(t):
    gs = [grads_at(t, d) for d in range(N_DEV)]
    return {k: np.mean([np.asarray(g[k], np.float64) for g in gs], axis=0) for k in SHAPES}


def test_warmup_is_adam():
    """On one device, the warm-up steps are optax.adam's, to the last bits:
    bit for bit is not to be had between two differently fused CPU
    programs, since XLA:CPU contracts a multiply and an add into one FMA
    depending on the fusion around them ((1 - b1) g + b1 m differs in the
    last bit in 10-30% of the elements between two fusions)."""
    mesh = mesh_of(1)
    tx = jc.optax.onebit_adam(LR, AXIS, "onebit", warmup_steps=100)
    _, got, _ = run(mesh, tx, 12)
    ref_tx = optax.adam(LR)

    def ref(steps):
        def one(state, t):
            u, state = ref_tx.update(grads_at(t, 0), state)
            return state, u

        return lax.scan(one, ref_tx.init(params0()), jnp.arange(steps))[1]

    want = jax.jit(ref, static_argnums=0)(12)
    for k in SHAPES:
        np.testing.assert_allclose(
            np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6 * LR, err_msg=k
        )


def test_identity_codec_is_adam_with_the_variance_frozen():
    """After the warm-up, with an exact codec, the update is Adam's with
    the second moment (and its bias correction) frozen at the warm-up's
    last step; the momentum goes on from the mean gradient."""
    mesh, warm, steps = mesh_of(N_DEV), 4, 12
    tx = jc.optax.onebit_adam(LR, AXIS, jc.codecs.Identity(), warmup_steps=warm)
    _, got, _ = run(mesh, tx, steps)
    mu = {k: np.zeros(s) for k, s in SHAPES.items()}
    nu = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t in range(steps):
        g = mean_grads(t)
        for k in SHAPES:
            mu[k] = B1 * mu[k] + (1 - B1) * g[k]
            if t < warm:
                nu[k] = B2 * nu[k] + (1 - B2) * g[k] ** 2
            mu_hat = mu[k] / (1 - B1 ** (t + 1))
            nu_hat = nu[k] / (1 - B2 ** min(t + 1, warm))
            want = -LR * mu_hat / (np.sqrt(nu_hat) + EPS)
            np.testing.assert_allclose(np.asarray(got[k][t]), want, rtol=2e-5, atol=1e-7)


@pytest.mark.slow
def test_momentum_error_feedback_conserves():
    """Nothing the codec drops from the momentum is lost: over 1,000 steps
    after the warm-up, P times the sum of the common momenta plus every
    device's residual equals the sum of the momenta the devices sent."""
    mesh, warm, steps = mesh_of(N_DEV), 3, 1000
    codec = jc.codecs.OneBit()
    tx = jc.optax.onebit_adam(LR, AXIS, codec, warmup_steps=warm, algorithm="allgather")
    state, _, mus = run(mesh, tx, steps)
    s = _adam_state(state)
    final_mu = {k: np.asarray(v, np.float64) for k, v in s.mu.items()}
    mus = {k: np.asarray(v, np.float64) for k, v in mus.items()}  # mu before each step
    after = {k: np.concatenate([mus[k][1:], final_mu[k][None]]) for k in SHAPES}  # mu after
    # What the devices sent after the warm-up: sum over devices and steps of
    # (1 - b1) grad + b1 mu (the device sums per step in one jitted call).
    per_step = jax.jit(
        lambda ts: jax.vmap(
            lambda t: jax.tree.map(lambda *g: sum(g), *[grads_at(t, d) for d in range(N_DEV)])
        )(ts)
    )(jnp.arange(warm, steps))
    sent = {
        k: (1 - B1) * np.asarray(per_step[k], np.float64).sum(0) + B1 * N_DEV * mus[k][warm:].sum(0)
        for k in SHAPES
    }
    residuals = {k: np.asarray(r, np.float64).sum(0) for k, r in s.compress.residuals.items()}
    got = {k: N_DEV * after[k][warm:].sum(0) + residuals[k] for k in SHAPES}

    def norm(tree):
        return sum(float(np.sum(tree[k] ** 2)) for k in SHAPES) ** 0.5

    gap = norm({k: got[k] - sent[k] for k in SHAPES})
    assert gap / norm(sent) < 1e-5
    # and the codec did drop something: the residuals are not zero
    assert norm(residuals) > 1e-3 * norm(sent) / steps


def test_resume_across_the_freeze_boundary_is_bit_identical():
    """Stopping before the freeze, saving the state to host memory (what a
    checkpoint holds) and going on gives the uninterrupted run's updates."""
    mesh, warm = mesh_of(N_DEV), 3
    tx = jc.optax.onebit_adam(LR, AXIS, "qsgd:bits=4", warmup_steps=warm, weight_decay=1e-4)
    _, whole, _ = run(mesh, tx, 8)
    state, first, _ = run(mesh, tx, 2)
    host = jax.tree.map(np.asarray, state)
    specs = jc.optax.state_specs(state, AXIS)
    restored = jax.tree.map(
        lambda a, sp: jax.device_put(a, jax.NamedSharding(mesh, sp)), host, specs
    )
    _, rest, _ = run(mesh, tx, 6, state=restored, t0=2)
    for k in SHAPES:
        np.testing.assert_array_equal(
            np.concatenate([np.asarray(first[k]), np.asarray(rest[k])]), np.asarray(whole[k])
        )


def test_state_layout_and_telemetry():
    mesh = mesh_of(N_DEV)
    tx = optax.inject_hyperparams(jc.optax.onebit_adam)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 100), axis_name=AXIS, warmup_steps=2
    )
    state = jc.optax.init(tx, params0(), mesh, AXIS)
    specs = jc.optax.state_specs(state, AXIS)
    s = _adam_state(specs)
    assert s.mu == {k: P() for k in SHAPES} and s.nu == {k: P() for k in SHAPES}
    assert s.compress.residuals == {k: P(AXIS) for k in SHAPES}
    state, _, _ = run(mesh, tx, 4)
    tel = jc.optax.telemetry(state)
    assert int(tel["step"]) == 4
    assert float(tel["compression_ratio"]) > 2  # OneBit after the warm-up (small leaves exact)


def test_warmup_steps_must_be_positive():
    with pytest.raises(ValueError, match="warmup_steps"):
        jc.optax.onebit_adam(LR, AXIS, warmup_steps=0)
