"""jc.optax.onebit_adam (1-bit Adam, Tang et al. 2021, Algorithm 1) on
simulated devices: plain Adam during the warm-up, Adam with the variance
frozen after it, conservation of the momentum's error feedback, resume across
the freeze boundary, and the state's layout."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import long_scan_options
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


def decaying_grads_at(t, d):
    """grads_at, scaled by 1 + 10 / (t + 1): a variance that settles."""
    return jax.tree.map(lambda g: g * (1 + 10 / (t + 1)), grads_at(t, d))


def run(mesh, tx, steps, state=None, t0=0, grads=grads_at):
    """``steps`` updates of ``tx`` on every device of ``mesh`` in one scan:
    returns (state, updates stacked over steps, mu before each step)."""
    return run_all(mesh, [(tx, steps, state, t0)], grads)[0]


def run_all(mesh, jobs, grads=grads_at):
    """Several runs, each ``(tx, steps, state, t0)`` as in ``run``, in one
    compiled program (each its own scan): one compile where a test compares
    runs; returns ``run``'s triple for each."""
    states, specs = [], []
    for tx, _, state, _ in jobs:
        if state is None:
            state = jc.optax.init(tx, params0(), mesh, AXIS)
        states.append(state)
        specs.append(jc.optax.state_specs(state, AXIS))

    def body(states):
        d = lax.axis_index(AXIS)
        out = []
        for (tx, steps, _, t0), state in zip(jobs, states, strict=True):

            def one(state, t, tx=tx):
                mu = _adam_state(state).mu
                u, state = tx.update(grads(t, d), state, params0())
                return state, (u, mu)

            out.append(lax.scan(one, state, t0 + jnp.arange(steps)))
        return out

    outs = [(s, P()) for s in specs]
    f = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=outs, check_vma=False)
    longest = max(steps for _, steps, _, _ in jobs)
    res = jax.jit(f, compiler_options=long_scan_options(longest))(states)
    return [(state, updates, mus) for state, (updates, mus) in res]


def _adam_state(state) -> jc.optax.OneBitAdamState:
    (s,) = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, jc.optax.OneBitAdamState))
        if isinstance(x, jc.optax.OneBitAdamState)
    ]
    return s


@functools.cache
def _all_grads(grads, steps):
    """Every device's gradients for steps 0..steps-1, stacked (steps, device,
    ...), in one jitted call."""
    return jax.jit(
        lambda: jax.vmap(lambda t: jax.vmap(lambda d: grads(t, d))(jnp.arange(N_DEV)))(
            jnp.arange(steps)
        )
    )()


def mean_grads(steps, grads=grads_at):
    """The devices' mean gradient at each of the first ``steps`` steps, in
    float64."""
    gs = _all_grads(grads, steps)
    means = {k: np.asarray(gs[k], np.float64).mean(axis=1) for k in SHAPES}
    return [{k: means[k][t] for k in SHAPES} for t in range(steps)]


def assert_frozen_adam(got, means, freeze):
    """``got`` (updates stacked over steps) are Adam's on the mean gradients
    ``means`` with the variance and its bias correction frozen after
    ``freeze`` steps, computed here in float64."""
    mu = {k: np.zeros(s) for k, s in SHAPES.items()}
    nu = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t, g in enumerate(means):
        for k in SHAPES:
            mu[k] = B1 * mu[k] + (1 - B1) * g[k]
            if t < freeze:
                nu[k] = B2 * nu[k] + (1 - B2) * g[k] ** 2
            mu_hat = mu[k] / (1 - B1 ** (t + 1))
            nu_hat = nu[k] / (1 - B2 ** min(t + 1, freeze))
            want = -LR * mu_hat / (np.sqrt(nu_hat) + EPS)
            np.testing.assert_allclose(np.asarray(got[k][t]), want, rtol=2e-5, atol=1e-7)


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


@pytest.mark.parametrize("send", ["momentum", "gradient"])
def test_identity_codec_is_adam_with_the_variance_frozen(send):
    """After the warm-up, with an exact codec, the update is Adam's with
    the second moment (and its bias correction) frozen at the warm-up's
    last step; the momentum goes on from the mean gradient, whether the
    devices send their momenta or only its new part."""
    mesh, warm, steps = mesh_of(N_DEV), 4, 12
    tx = jc.optax.onebit_adam(LR, AXIS, jc.codecs.Identity(), warmup_steps=warm, send=send)
    _, got, _ = run(mesh, tx, steps)
    assert_frozen_adam(got, mean_grads(steps), warm)


@pytest.mark.parametrize(
    "codec, same_as",
    [("onebit:bucket_size=256", "momentum"), ("topk:fraction=0.05", "gradient")],
)
def test_send_auto_follows_the_codec_rate(codec, same_as):
    """send="auto": a sparse (or variable-rate) codec sends only the
    momentum's new part, a dense one the whole momentum."""
    mesh = mesh_of(N_DEV)

    sends = ["auto", same_as, "gradient" if same_as == "momentum" else "momentum"]
    txs = [jc.optax.onebit_adam(LR, AXIS, codec, warmup_steps=2, send=send) for send in sends]
    auto, same, other = (u for _, u, _ in run_all(mesh, [(tx, 5, None, 0) for tx in txs]))
    for k in ("a", "c"):
        np.testing.assert_array_equal(np.asarray(auto[k]), np.asarray(same[k]))
    assert not np.array_equal(np.asarray(auto["a"][2:]), np.asarray(other["a"][2:]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "codec, send", [(jc.codecs.OneBit(), "momentum"), (jc.codecs.TopK(fraction=0.05), "gradient")]
)
def test_momentum_error_feedback_conserves(codec, send):
    """Nothing the codec drops from the momentum is lost: over 300 steps
    after the warm-up, P times the sum of what the common momentum took in
    (mu, or mu - b1 mu_prev where only the new part is sent) plus every
    device's residual equals the sum of what the devices sent. (300 steps:
    the books balance at every step or at none; the 1,000-step case of the
    suite is the gradient's, tests/test_optax.py.)"""
    mesh, warm, steps = mesh_of(N_DEV), 3, 300
    tx = jc.optax.onebit_adam(LR, AXIS, codec, warmup_steps=warm, algorithm="allgather", send=send)
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
    echo = B1 if send == "momentum" else 0.0  # the part of mu_prev each device sent
    sent = {
        k: (1 - B1) * np.asarray(per_step[k], np.float64).sum(0)
        + echo * N_DEV * mus[k][warm:].sum(0)
        for k in SHAPES
    }
    residuals = {k: np.asarray(r, np.float64).sum(0) for k, r in s.compress.residuals.items()}
    took = {k: after[k][warm:] - (B1 - echo) * mus[k][warm:] for k in SHAPES}
    got = {k: N_DEV * took[k].sum(0) + residuals[k] for k in SHAPES}

    def norm(tree):
        return sum(float(np.sum(tree[k] ** 2)) for k in SHAPES) ** 0.5

    gap = norm({k: got[k] - sent[k] for k in SHAPES})
    assert gap / norm(sent) < 1e-5
    # and the codec did drop something: the residuals are not zero
    assert norm(residuals) > 1e-3 * norm(sent) / steps


def test_orbax_resume_across_the_freeze_boundary_is_bit_identical(tmp_path):
    """Stopping before the freeze, saving the state with orbax, restoring it
    (per-device parts sharded again) and going on past the freeze gives the
    uninterrupted run's updates and state bit for bit."""
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh, warm = mesh_of(N_DEV), 3
    tx = jc.optax.onebit_adam(LR, AXIS, "qsgd:bits=4", warmup_steps=warm, weight_decay=1e-4)
    (whole_state, whole, _), (state, first, _) = run_all(mesh, [(tx, 8, None, 0), (tx, 2, None, 0)])
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert _adam_state(restored).compress.residuals["a"].sharding.spec == P(AXIS)
    rest_state, rest, _ = run(mesh, tx, 6, state=restored, t0=2)
    for k in SHAPES:
        np.testing.assert_array_equal(
            np.concatenate([np.asarray(first[k]), np.asarray(rest[k])]), np.asarray(whole[k])
        )
    for x, y in zip(jax.tree.leaves(rest_state), jax.tree.leaves(whole_state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_pmap_gives_the_shard_map_updates():
    """The same transformation under jax.pmap (state from jax.pmap(tx.init))
    gives shard_map's updates, up to the last bits: the two programs are
    fused differently, and XLA's multiply-add contraction differs."""
    mesh, warm, steps = mesh_of(N_DEV), 2, 5
    tx = jc.optax.onebit_adam(LR, AXIS, "onebit", warmup_steps=warm)
    _, want, _ = run(mesh, tx, steps)
    state = jax.pmap(tx.init, axis_name=AXIS)(
        jax.tree.map(lambda a: jnp.stack([a] * N_DEV), params0())
    )

    def step(state, t):
        u, state = tx.update(grads_at(t, lax.axis_index(AXIS)), state, params0())
        return state, u

    f = jax.pmap(step, axis_name=AXIS, in_axes=(0, None))
    for t in range(steps):
        state, u = f(state, t)
        for k in SHAPES:
            got = np.asarray(u[k])
            np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))  # replicated
            np.testing.assert_allclose(got[0], np.asarray(want[k][t]), rtol=1e-5, atol=1e-6 * LR)
    assert int(jc.optax.telemetry(state)["step"][0]) == steps


def test_the_freeze_rule_freezes_where_the_variance_settles():
    """With freeze_tolerance the variance freezes at the first check (every
    freeze_interval steps) where the sum of the bias-corrected variance
    moved by less than the tolerance since the previous check, computed here
    in numpy from the mean gradients; from then on the update is Adam's with
    the variance frozen there (exact codec)."""
    mesh, tol, every, steps = mesh_of(N_DEV), 0.1, 2, 24
    tx = jc.optax.onebit_adam(
        LR,
        AXIS,
        jc.codecs.Identity(),
        warmup_steps=1000,
        freeze_tolerance=tol,
        freeze_interval=every,
    )
    state, got, _ = run(mesh, tx, steps, grads=decaying_grads_at)
    means = mean_grads(steps, decaying_grads_at)
    nu = {k: np.zeros(s) for k, s in SHAPES.items()}
    sums, want_freeze = {}, None
    for t in range(steps):
        g = means[t]
        for k in SHAPES:
            nu[k] = B2 * nu[k] + (1 - B2) * g[k] ** 2
        if (t + 1) % every == 0:
            sums[t + 1] = sum(v.sum() for v in nu.values()) / (1 - B2 ** (t + 1))
            prev = sums.get(t + 1 - every)
            if prev is not None and abs(sums[t + 1] / prev - 1) < tol:
                want_freeze = t + 1
                break
    assert want_freeze is not None and 2 * every < want_freeze < steps - 4
    assert int(_adam_state(state).frozen_at) == want_freeze
    assert_frozen_adam(got, means, want_freeze)


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


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"warmup_steps": 5, "send": "gradients"}, "send"),
        ({"warmup_steps": 5, "freeze_tolerance": 1.5}, "freeze_tolerance"),
        ({"warmup_steps": 5, "freeze_interval": 0}, "freeze_interval"),
        # the options shared with compress_gradients, under this one's name
        ({"warmup_steps": 5, "algorithm": "bogus"}, r"^jc\.optax\.onebit_adam: algorithm"),
        ({"warmup_steps": 5, "fusion_bytes": 0}, r"^jc\.optax\.onebit_adam: fusion_bytes"),
    ],
)
def test_bad_configuration(kw, match):
    with pytest.raises(ValueError, match=match):
        jc.optax.onebit_adam(LR, AXIS, **kw)


def test_update_outside_the_mapped_step_is_reported_under_onebit_adam():
    tx = jc.optax.scale_by_onebit_adam(AXIS, warmup_steps=2)
    state = tx.init(params0())
    with pytest.raises(ValueError, match=r"^jc\.optax\.onebit_adam: update must run inside"):
        tx.update(grads_at(0, 0), state)


def test_a_coarse_codec_before_adam_warns_once():
    """jc.optax.init warns (once per codec and optimizer) when a codec of
    fewer than 8 bits per element is chained before an optimizer that
    divides by a second moment, and points at onebit_adam; not for a finer
    codec, for SGD after it, or for onebit_adam itself."""
    mesh = mesh_of(N_DEV)

    def init(codec, opt):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            jc.optax.init(
                optax.chain(jc.optax.compress_gradients(codec, AXIS), opt), params0(), mesh, AXIS
            )
        return [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]

    (msg,) = init("signsgd:bucket_size=128", optax.adamw(LR))
    assert "onebit_adam" in msg and "signsgd" in msg and "ScaleByAdamState" in msg
    assert init("signsgd:bucket_size=128", optax.adamw(LR)) == []  # once
    assert len(init("topk:fraction=0.05", optax.lamb(LR))) == 1
    assert init("topk:fraction=0.05", optax.sgd(LR, momentum=0.9)) == []
    assert init("int8", optax.adam(LR)) == []
    assert len(init("qsgd:bits=4", optax.adam(LR))) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jc.optax.init(jc.optax.onebit_adam(LR, AXIS, warmup_steps=2), params0(), mesh, AXIS)


def test_an_optimizer_before_the_all_reduce_is_refused():
    """jc.optax.init refuses a chain whose optimizer with gradient
    statistics (Adam's moments, a momentum trace) runs before the
    compressed all-reduce; stateless transformations before it are fine."""
    mesh = mesh_of(N_DEV)
    for first in (optax.adamw(LR), optax.sgd(LR, momentum=0.9)):
        tx = optax.chain(first, jc.optax.compress_gradients("qsgd:bits=4", AXIS))
        with pytest.raises(ValueError, match="before the compressed all-reduce"):
            jc.optax.init(tx, params0(), mesh, AXIS)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        jc.optax.compress_gradients("qsgd:bits=4", AXIS),
        optax.sgd(LR, momentum=0.9),
    )
    jc.optax.init(tx, params0(), mesh, AXIS)
    # apply_if_finite around the all-reduce would deadlock (it decides per
    # device); after it, it is fine.
    around = optax.apply_if_finite(
        optax.chain(jc.optax.compress_gradients("qsgd:bits=4", AXIS), optax.sgd(LR)), 3
    )
    with pytest.raises(ValueError, match="apply_if_finite wraps the compressed all-reduce"):
        jc.optax.init(around, params0(), mesh, AXIS)
    after = optax.chain(
        jc.optax.compress_gradients("qsgd:bits=4", AXIS), optax.apply_if_finite(optax.sgd(LR), 3)
    )
    jc.optax.init(after, params0(), mesh, AXIS)


def test_state_specs_refuses_a_state_from_a_plain_init():
    """A state from tx.init outside the mesh (one residual row on one
    device) gets an error naming jc.optax.init, not shard_map's "does not
    evenly divide"; eval_shape'd states and jc.optax.init's pass."""
    mesh = mesh_of(N_DEV)
    tx = optax.chain(jc.optax.compress_gradients("qsgd:bits=4", AXIS), optax.sgd(LR))
    with pytest.raises(ValueError, match=r"jc\.optax\.init\(tx, params, mesh"):
        jc.optax.state_specs(tx.init(params0()), AXIS)
    jc.optax.state_specs(jax.eval_shape(tx.init, params0()), AXIS)
    jc.optax.state_specs(jc.optax.init(tx, params0(), mesh, AXIS), AXIS)
