"""jc.optax.powersgd (Vogels et al. 2019) on simulated devices: against a
numpy implementation of the paper's Algorithm 1 with error feedback and warm
start written here, conservation, the warm-up, bf16 gradients, zero and
rank-deficient gradients, the bytes on the wire in the compiled HLO, a
codec for the other leaves, the hierarchical mesh, pmap and orbax."""

import functools
import re

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
# "w" is 40 x 30, the 4-D kernel is viewed as 36 x 8, "b" and "s" are not
# matrices, "t" (6 x 5) is one whose rank-2 factors would not save 2x.
SHAPES = {"w": (40, 30), "k": (3, 3, 4, 8), "b": (30,), "t": (6, 5)}
MATRICES = {"w": (40, 30), "k": (36, 8)}
RANK = 2


def mesh_of(n=N_DEV, shape=None, names=(AXIS,)):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return _mesh(shape or (n,), names)


@functools.cache
def _mesh(shape, names):
    # one object per layout, so that run() reuses its programs across tests
    auto = (jax.sharding.AxisType.Auto,) * len(names)
    return jax.make_mesh(shape, names, axis_types=auto)


# powersgd(AXIS, RANK), shared by the tests that need no other options, so
# that run() compiles its 6-step program once
TX = jc.optax.powersgd(AXIS, RANK)


def params0(dtype=jnp.float32):
    return {k: jnp.zeros(s, dtype) for k, s in SHAPES.items()}


def grads_at(t, d, dtype=jnp.float32):
    """Device d's gradient at step t: a common low-rank-ish part plus noise
    of its own."""
    key = jax.random.fold_in(jax.random.key(3), t)
    out = {}
    for i, (k, s) in enumerate(SHAPES.items()):
        ka, kb, kn = jax.random.split(jax.random.fold_in(key, i), 3)
        n, m = int(np.prod(s[:-1])), s[-1]
        common = jax.random.normal(ka, (n, 3)) @ jax.random.normal(kb, (3, m))
        noise = jax.random.normal(jax.random.fold_in(kn, d), (n, m))
        out[k] = (common + 0.5 * noise).reshape(s).astype(dtype)
    return out


GRAD_STEPS = 40  # the longest run below


@functools.cache
def _grads_np():
    def at(t):
        return jax.vmap(lambda d: grads_at(t, d))(jnp.arange(N_DEV))

    g = jax.jit(jax.vmap(at))(jnp.arange(GRAD_STEPS))
    return {k: np.asarray(v, np.float64) for k, v in g.items()}


def grads_np(steps):
    """Every device's gradients of steps 0..steps-1, from one compiled call:
    {leaf: float64 [steps, devices, ...]} (the numpy references' input)."""
    assert steps <= GRAD_STEPS
    return {k: v[:steps] for k, v in _grads_np().items()}


_COMPILED: dict = {}


def run(mesh, tx, steps, state=None, t0=0, axes=AXIS, dtype=jnp.float32):
    """``steps`` updates on every device in one scan, from step ``t0``:
    (state, updates). Compiled once per (mesh, tx, steps, dtype)."""
    if state is None:
        state = jc.optax.init(tx, params0(dtype), mesh, axes)
    key = (id(mesh), id(tx), steps, axes, dtype)
    if key not in _COMPILED:
        specs = jc.optax.state_specs(state, axes)

        def body(state, t0):
            d = lax.axis_index(axes)

            def one(state, t):
                return tx.update(grads_at(t, d, dtype), state, params0(dtype))[::-1]

            return lax.scan(one, state, t0 + jnp.arange(steps))

        f = jax.shard_map(
            body, mesh=mesh, in_specs=(specs, P()), out_specs=(specs, P()), check_vma=False
        )
        _COMPILED[key] = (jax.jit(f), tx, mesh)  # keeps tx and mesh alive: ids stay unique
    return _COMPILED[key][0](state, jnp.int32(t0))


def orth(p):
    """Gram-Schmidt in numpy: QR with a positive diagonal."""
    q, r = np.linalg.qr(p)
    return q * np.sign(np.diag(r))


def reference(steps, q0, warmup=0):
    """PowerSGD, Algorithms 1 and 2 of the paper, in numpy (float64): per
    matrix, M_d = g_d + e_d; P = mean_d(M_d Q); P <- orth(P); Q =
    mean_d(M_d^T P); update P Q^T; e_d = M_d - P Q^T; Q kept. Other leaves:
    the exact mean."""
    q = {k: np.asarray(v, np.float64) for k, v in q0.items()}
    e = {k: np.zeros((N_DEV, *s)) for k, s in MATRICES.items()}
    updates = []
    g = grads_np(steps)
    for t in range(steps):
        out = {k: g[k][t].mean(0) for k in SHAPES if k not in MATRICES}
        for k, (n, m) in MATRICES.items():
            ms = g[k][t].reshape(N_DEV, n, m) + e[k]
            if t < warmup:
                approx, e[k] = ms.mean(0), np.zeros_like(ms)
            else:
                p = orth(np.mean(ms @ q[k], axis=0))
                q[k] = np.mean(np.transpose(ms, (0, 2, 1)) @ p, axis=0)
                approx = p @ q[k].T
                e[k] = ms - approx
            out[k] = approx.reshape(SHAPES[k])
        updates.append(out)
    return updates, e, q


def test_matches_the_paper_algorithm_in_numpy():
    mesh, tx = mesh_of(), TX
    state0 = jc.optax.init(tx, params0(), mesh, AXIS)
    q0 = {k: state0.qs[k] for k in MATRICES}
    assert state0.qs["b"] == optax.MaskedNode() and state0.qs["t"] == optax.MaskedNode()
    state, got = run(mesh, tx, 6, state=state0)
    want, e, q = reference(6, q0)
    for t in range(6):
        for k in SHAPES:
            np.testing.assert_allclose(
                np.asarray(got[k][t]), want[t][k], rtol=2e-4, atol=2e-4, err_msg=f"{k} {t}"
            )
    for k in MATRICES:
        np.testing.assert_allclose(
            np.asarray(state.residuals[k]).reshape(e[k].shape), e[k], rtol=1e-3, atol=1e-3
        )
        np.testing.assert_allclose(np.asarray(state.qs[k]), q[k], rtol=1e-3, atol=1e-3)
    # rank 2 drops most of a 40 x 30 matrix of noise: the residuals are not small
    assert np.abs(e["w"]).mean() > 0.1


def test_conserves_the_gradient_sum_and_warms_up_exactly():
    """P times the sum of the updates plus the residuals equals the sum of
    every device's gradients; the warm-up steps are the exact mean, leave
    no residual and keep Q."""
    mesh, warm, steps = mesh_of(), 2, 40
    tx = jc.optax.powersgd(AXIS, RANK, warmup_steps=warm)
    state0 = jc.optax.init(tx, params0(), mesh, AXIS)
    # the 40 steps as 20 calls of the warm-up's 2-step program (one compile)
    s2, first = run(mesh, tx, warm, state=state0)
    state, got = s2, [first]
    for t0 in range(warm, steps, warm):
        state, u = run(mesh, tx, warm, state=state, t0=t0)
        got.append(u)
    got = {k: np.concatenate([np.asarray(u[k], np.float64) for u in got]) for k in SHAPES}
    assert got["w"].shape[0] == steps
    total = {k: v.sum(axis=(0, 1)) for k, v in grads_np(steps).items()}
    for k in SHAPES:
        applied = N_DEV * got[k].sum(0)
        res = np.asarray(state.residuals[k], np.float64).sum(0) if k in MATRICES else 0.0
        gap = np.linalg.norm(applied + res - total[k]) / np.linalg.norm(total[k])
        assert gap < 1e-5, (k, gap)
    # the warm-up: exact means, zero residuals, the initial Q
    mean0 = {k: v[0].mean(0) for k, v in grads_np(1).items()}
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(first[k][0]), mean0[k], rtol=1e-6, atol=1e-6)
    for k in MATRICES:
        assert not np.asarray(s2.residuals[k]).any()
        np.testing.assert_array_equal(np.asarray(s2.qs[k]), np.asarray(state0.qs[k]))
    tel = jc.optax.telemetry(state)
    assert int(tel["step"]) == steps


def test_bytes_on_the_wire_in_the_compiled_hlo():
    """One all-reduce of every P (sum of n r) and the other leaves (exact,
    float32: one latency less than an all-reduce of their own), one of
    every Q (sum of m r); the telemetry counts the same bytes."""
    mesh = mesh_of()
    tx = jc.optax.powersgd(AXIS, RANK)
    state = jc.optax.init(tx, params0(), mesh, AXIS)
    specs = jc.optax.state_specs(state, AXIS)

    def step(state):
        return tx.update(grads_at(0, lax.axis_index(AXIS)), state, params0())

    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(specs,), out_specs=(P(), specs), check_vma=False)
    )
    hlo = f.lower(state).compile().as_text()
    sizes = sorted(int(m) for m in re.findall(r"f32\[(\d+)\]\{0\} all-reduce\(", hlo))
    n_r = sum(n * RANK for n, _ in MATRICES.values())
    m_r = sum(m * RANK for _, m in MATRICES.values())
    rest = 30 + 30  # "b" and "t"
    assert sizes == sorted([n_r + rest, m_r]), sizes
    _, state = f(state)
    tel = jc.optax.telemetry(state)
    want_wire = 2 * (N_DEV - 1) / N_DEV * 4 * (n_r + m_r + rest)
    np.testing.assert_allclose(float(tel["wire_bytes"]), want_wire, rtol=1e-6)
    n = sum(int(np.prod(s)) for s in SHAPES.values())
    np.testing.assert_allclose(float(tel["bits_per_element"]), 32 * (n_r + m_r + rest) / n, 1e-6)


def test_bf16_gradients_zero_and_rank_deficient_matrices():
    """bf16 gradients give bf16 updates (the factors in float32); a zero
    gradient gives a zero update, and a rank-1 one (P's second column
    vanishes) its exact mean, both finite."""
    mesh = mesh_of()
    tx = jc.optax.powersgd(AXIS, RANK)
    state, got = run(mesh, tx, 2, dtype=jnp.bfloat16)
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(got))
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(state.residuals))
    assert all(np.isfinite(np.asarray(v, np.float32)).all() for v in jax.tree.leaves(got))

    u = jnp.arange(40.0) / 40
    v = jnp.cos(jnp.arange(30.0))
    state0 = jc.optax.init(tx, params0(), mesh, AXIS)
    specs = jc.optax.state_specs(state0, AXIS)

    def step(state, g):
        grads = {**params0(), "w": g}
        return tx.update(grads, state, params0())

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs)))
    for g in (jnp.zeros((40, 30)), jnp.outer(u, v)):
        upd, _ = f(state0, g)
        np.testing.assert_allclose(np.asarray(upd["w"]), np.asarray(g), atol=1e-5)


def test_rest_codec_state_specs_and_orbax(tmp_path):
    """The other leaves through compress_gradients with a codec; the state
    lays out per device what is per device; an orbax checkpoint restores
    and resumes bit for bit."""
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = mesh_of()
    tx = optax.chain(jc.optax.powersgd(AXIS, RANK, rest="int8:bucket_size=8"), optax.sgd(0.1))
    state0 = jc.optax.init(tx, params0(), mesh, AXIS)
    specs = jc.optax.state_specs(state0, AXIS)
    assert specs[0].residuals["w"] == P(AXIS) and specs[0].qs["w"] == P()
    assert isinstance(state0[0].rest, jc.optax.CompressState)
    assert specs[0].rest.residuals == [P(AXIS), P(AXIS)]  # "b" and "t"
    # one 2-step program (one compile): steps 0-1, then 2-3 from the state
    # in memory and from its checkpoint
    half, first = run(mesh, tx, 2, state=state0)
    # the int8 leaves are not the exact mean
    mean0 = np.asarray(grads_np(1)["b"][0].mean(0), np.float32)
    assert not np.array_equal(-np.asarray(first["b"][0]) / 0.1, mean0)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "c", half)
    ckpt.wait_until_finished()
    whole, second = run(mesh, tx, 2, state=half, t0=2)
    restored = ckpt.restore(tmp_path / "c", jax.tree.map(ocp.utils.to_shape_dtype_struct, half))
    rest_state, rest = run(mesh, tx, 2, state=restored, t0=2)
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(rest[k]), np.asarray(second[k]))
    for a, b in zip(jax.tree.leaves(rest_state), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hierarchical_mesh_and_pmap():
    """On a (slow, fast) mesh the exact mean over the fast axis comes first
    and the devices of a fast group hold one residual; conservation holds.
    Under pmap the updates are shard_map's (to the last bits)."""
    mesh = mesh_of(8, (2, 4), ("slow", "fast"))
    axes = ("slow", "fast")
    tx = jc.optax.powersgd(axes, RANK)
    state, got = run(mesh, tx, 6, axes=axes)
    res = np.asarray(state.residuals["w"])
    np.testing.assert_array_equal(res[0], res[3])  # one fast group
    assert not np.array_equal(res[0], res[4])
    total = grads_np(6)["w"].sum(axis=(0, 1))
    applied = 8 * np.asarray(got["w"], np.float64).sum(0) + res.sum(0)
    assert np.linalg.norm(applied - total) / np.linalg.norm(total) < 1e-5

    flat, tx = mesh_of(), TX
    _, want = run(flat, tx, 6)  # the first 3 steps of the paper test's program
    state = jax.pmap(tx.init, axis_name=AXIS)(
        jax.tree.map(lambda a: jnp.stack([a] * N_DEV), params0())
    )
    f = jax.pmap(
        lambda s, t: tx.update(grads_at(t, lax.axis_index(AXIS)), s, params0())[::-1],
        axis_name=AXIS,
        in_axes=(0, None),
    )
    for t in range(3):
        state, u = f(state, t)
        for k in SHAPES:
            np.testing.assert_allclose(np.asarray(u[k][3]), np.asarray(want[k][t]), 1e-5, 1e-5)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2.0}, "rank"),
        ({"min_compression_rate": -1}, "min_compression_rate"),
        ({"warmup_steps": -1}, r"^jc\.optax\.powersgd: warmup_steps"),
        ({"on_nonfinite": "drop"}, r"^jc\.optax\.powersgd: on_nonfinite"),
    ],
)
def test_bad_configuration(kw, match):
    with pytest.raises(ValueError, match=match):
        jc.optax.powersgd(AXIS, **kw)


def test_update_outside_the_mapped_step_is_reported_under_powersgd():
    tx = jc.optax.powersgd(AXIS)
    state = tx.init(params0())
    with pytest.raises(ValueError, match=r"^jc\.optax\.powersgd: update must run inside"):
        tx.update(grads_at(0, 0), state)
