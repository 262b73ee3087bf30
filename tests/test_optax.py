"""jc.optax.compress_gradients on 8 simulated devices: conservation of error
feedback, fusion, policy, warm-up, telemetry, pmap vs shard_map, orbax
checkpoints, optax wrappers and misuse errors."""

import functools
import re
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
from jaxcomp.optax._plan import make_plan

N_DEV = 8
AXIS = "data"


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N_DEV:
        pytest.skip(f"needs {N_DEV} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax.make_mesh((N_DEV,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


HIER = ("node", "local")


@pytest.fixture(scope="module")
def mesh2d():
    if len(jax.devices()) < N_DEV:
        pytest.skip(f"needs {N_DEV} devices")
    return jax.make_mesh((4, 2), HIER, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def mesh_axis(mesh):
    """The data-parallel axis of a test mesh: "data", or the hierarchical pair."""
    return AXIS if mesh.axis_names == (AXIS,) else tuple(mesh.axis_names)


def mesh_axis_sizes(mesh):
    sizes = tuple(mesh.shape[a] for a in mesh.axis_names)
    return sizes[0] if len(sizes) == 1 else sizes


# Codec configurations for the conservation test, by registered name; a
# codec registered later without an entry here runs with its defaults.
CONFIGS = {
    "qsgd": [dict(bits=4), dict(bits=8)],
    "onebit": [{}],
    "int8": [{}],
    "terngrad": [{}],
    "natural": [{}],
    "cast": [dict(dtype="bfloat16")],
    "threelc": [{}],
    "topk": [dict(fraction=0.05)],
    "identity": [{}],
}
ALL_CODECS = [
    jc.codecs.get(name, **kw) for name in jc.codecs.names() for kw in CONFIGS.get(name, [{}])
]


def _algorithms(codec) -> list[str]:
    """Every algorithm that carries ``codec``: the sparse one for sparse
    codecs, allreduce for linear ones, the dense ones for all."""
    algs = ["allgather", "two_phase", "ring", "hierarchical"]
    if codec.rate is jc.codecs.Rate.SPARSE:
        algs.append("sparse")
    if codec.rate is jc.codecs.Rate.LINEAR:
        algs.append("allreduce")
    return algs


# The fast tier runs one case per algorithm (each with a server residual of
# its own shape): the default path (QSGD-4, two-phase, the one-pass kernels
# of both stages on the CPU) over 1000 steps, the others over 100. The slow
# tier covers the rest without the full codec x algorithm product:
# conservation is an identity of the algorithm's two stages, which
# tests/test_collectives.py checks for every algorithm with every Rate (the
# codec enters only through what its payload is). Here every codec goes
# through compress_gradients: the FIXED codecs spread over the dense
# algorithms, each codec with one of them and each dense algorithm with at
# least two codecs, and the others (3LC's variable-length streams, top-k's
# sparse pairs, the linear identity) with two-phase, their own algorithm
# (sparse, allreduce) and, for 3LC, allgather.
FAST = {
    (jc.codecs.QSGD(bits=4), "two_phase"),
    (jc.codecs.OneBit(), "ring"),
    (jc.codecs.Int8(), "allgather"),
    (jc.codecs.TopK(fraction=0.05), "sparse"),
    (jc.codecs.QSGD(bits=4), "hierarchical"),
}
LONG = (jc.codecs.QSGD(bits=4), "two_phase")  # 1000 steps
DENSE = ("allgather", "two_phase", "ring", "hierarchical")


def _slow_cases():
    fixed = [c for c in ALL_CODECS if c.rate is jc.codecs.Rate.FIXED]
    for c in ALL_CODECS:
        if c.rate is jc.codecs.Rate.FIXED:
            # Rotated so that the fast tier's pair is not repeated.
            i = fixed.index(c) + 1
            yield c, DENSE[i % len(DENSE)]
        else:
            own = [a for a in _algorithms(c) if a not in DENSE] or ["allgather"]
            yield from ((c, alg) for alg in ["two_phase", *own])


CONSERVATION = [
    pytest.param(c, alg, id=f"{repr(c).replace(' ', '')}-{alg}")
    for c, alg in sorted(FAST, key=repr)
] + [
    pytest.param(c, alg, marks=pytest.mark.slow, id=f"{repr(c).replace(' ', '')}-{alg}")
    for c, alg in _slow_cases()
    if (c, alg) not in FAST
]


def codec_id(c) -> str:
    return repr(c).replace(" ", "")


SHAPES = {"a": (40, 50), "b": (300,), "c": (1500,)}  # b: below min_compress_size
SCALE = {"a": 1.0, "b": 0.1, "c": 3.0}


def params0():
    return {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}


def grads_at(t, d):
    """Device d's gradient at step t: random, with a per-leaf scale and a
    common offset, so the sums do not cancel."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(42), t), d)
    keys = jax.random.split(key, len(SHAPES))
    return {
        k: SCALE[k] * (jax.random.normal(kk, s) + 0.25)
        for kk, (k, s) in zip(keys, sorted(SHAPES.items()), strict=True)
    }


def make_tx(codec, axis=AXIS, **kw):
    kw.setdefault("min_compress_size", 512)
    kw.setdefault("fusion_bytes", 6000)
    return jc.optax.compress_gradients(codec, axis, **kw)


def scan_updates(mesh, tx, steps, state=None, t0=0):
    """Runs ``steps`` updates of ``tx`` on every device (gradients from
    grads_at) in one lax.scan under shard_map; returns (state, updates
    stacked over steps, telemetry stacked over steps)."""
    axis = mesh_axis(mesh)
    if state is None:
        state = jc.optax.init(tx, params0(), mesh, axis)
    specs = jc.optax.state_specs(state, axis)

    def body(state):
        d = lax.axis_index(axis)

        def one(state, t):
            u, state = tx.update(grads_at(t, d), state)
            return state, (u, jc.optax.telemetry(state))

        state, (updates, telemetry) = lax.scan(one, state, t0 + jnp.arange(steps))
        return state, updates, telemetry

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(specs,), out_specs=(specs, P(), P()), check_vma=False
        ),
        compiler_options=long_scan_options(steps),
    )
    return f(state)


def mapped_update(mesh, tx, specs):
    """``tx.update`` on every device of ``mesh``: ``(grads with a leading
    device axis, state laid out by specs) -> (updates, state)``."""
    return jax.shard_map(
        lambda g, s: tx.update(jax.tree.map(lambda a: a[0], g), s),
        mesh=mesh,
        in_specs=(P(AXIS), specs),
        out_specs=(P(), specs),
        check_vma=False,
    )


def residual_leaves(state):
    """The per-device residuals of a shard_map state: {leaf: float64
    [devices, ...]} (the state holds them shaped like the parameters)."""
    (cs,) = [s for s in state if isinstance(s, jc.optax.CompressState)] or [state]
    out = {k: np.asarray(r, np.float64) for k, r in cs.residuals.items()}
    assert {k: v.shape for k, v in out.items()} == {k: (N_DEV, *s) for k, s in SHAPES.items()}
    return out


@functools.cache
def reference_grad_sum(steps):
    def at(t):
        return jax.vmap(lambda d: grads_at(t, d))(jnp.arange(N_DEV))

    g = jax.jit(jax.vmap(at))(jnp.arange(steps))  # [steps, devices, ...]
    return {k: np.asarray(v, np.float64).sum(axis=(0, 1)) for k, v in g.items()}


def server_leaves(state, codec, algorithm="auto", axis_sizes=N_DEV, **tx_kw):
    """What the server residuals of a state (made by ``make_tx(codec,
    **tx_kw)``) still hold back, in units of the sum, as parameter-shaped
    float64 arrays: each device's rows placed at the positions of the fused
    bucket they belong to (``jc.collectives.state_positions``), times the
    number of devices (they are in units of the mean)."""
    (cs,) = [s for s in state if isinstance(s, jc.optax.CompressState)] or [state]
    tx_kw.setdefault("min_compress_size", 512)
    tx_kw.setdefault("fusion_bytes", 6000)
    plan = make_plan(codec, params0(), **tx_kw)
    keys = sorted(SHAPES)
    out = {k: np.zeros(int(np.prod(s))) for k, s in SHAPES.items()}
    assert len(cs.server_residuals) == len(plan.buckets)
    for b, srv in zip(plan.buckets, cs.server_residuals, strict=True):
        pos = jc.collectives.state_positions(b.codec, b.size, b.dtype, axis_sizes, algorithm)
        vals = np.asarray(srv, np.float64)
        if not pos.shape[1]:  # the algorithm keeps none: a placeholder row, always zero
            assert vals.shape == (pos.shape[0], 1) and not vals.any()
            continue
        assert vals.shape == pos.shape
        fused = np.zeros(b.size)
        np.add.at(fused, pos[pos >= 0], vals[pos >= 0])
        offset = 0
        for i, n in zip(b.leaves, b.sizes, strict=True):
            out[keys[i]] += fused[offset : offset + n]
            offset += n
    return {k: N_DEV * v.reshape(SHAPES[k]) for k, v in out.items()}


def conservation_gap(applied, state, steps, server=None):
    """|P x applied + residuals + server residuals - sum of the gradients|,
    relative to the largest of those terms, for ``applied``, the sum of the
    mean updates of steps 0..steps-1, the final state (None: leave the
    residuals out) and the server residuals as :func:`server_leaves` gives
    them (None: none). The largest term is the sum of the gradients unless
    the residuals grow past it (a codec that error feedback cannot tame,
    such as TernGrad in the ring), where float32 rounding scales with them."""
    terms = [{k: N_DEV * np.asarray(v, np.float64) for k, v in applied.items()}]
    if state is not None:
        terms.append({k: r.sum(0) for k, r in residual_leaves(state).items()})
    if server:
        terms.append(server)
    ref = reference_grad_sum(steps)
    total = {k: sum(t[k] for t in terms) for k in ref}

    def norm(tree):
        return sum(float(np.sum(tree[k] ** 2)) for k in ref) ** 0.5

    gap = norm({k: total[k] - ref[k] for k in ref})
    return gap / max(norm(ref), *(norm(t) for t in terms))


def conservation_error(mesh, codec, steps, error_feedback=True, algorithm="auto"):
    tx = make_tx(codec, mesh_axis(mesh), error_feedback=error_feedback, algorithm=algorithm)
    state, updates, _ = scan_updates(mesh, tx, steps)
    applied = {k: np.asarray(u, np.float64).sum(0) for k, u in updates.items()}
    if not error_feedback:
        return conservation_gap(applied, None, steps)
    server = server_leaves(state, codec, algorithm, mesh_axis_sizes(mesh))
    return conservation_gap(applied, state, steps, server)


# ---------------------------------------------------------------------------
# Conservation: applied x P + residuals == sum of the gradients
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec, algorithm", CONSERVATION)
def test_error_feedback_conserves_the_gradient_sum(mesh, mesh2d, codec, algorithm):
    """Two-level error feedback loses nothing: over 1000 steps (the
    default path; 100 for the other cases), the applied means (times P)
    plus every device's residual plus the server residuals (times P) equal
    the sum of the gradients."""
    m = mesh2d if algorithm == "hierarchical" else mesh
    steps = 1000 if (codec, algorithm) == LONG else 100
    assert conservation_error(m, codec, steps, algorithm=algorithm) < 1e-5


@pytest.mark.parametrize("spec", ["int8", "onebit", "fp8:format=e4m3"])
def test_one_device_step_is_the_codecs_round_trip_with_error_feedback(spec):
    """On a one-device mesh (one GPU is a real case) nothing crosses a wire,
    and the step runs the first compression of the algorithms (one pass
    where the codec has the kernel) and decodes its own payload: each
    update is decode(encode(g + r)), and r keeps g + r minus it, bit for bit
    as the codec's own calls and one float32 add and subtract give them."""
    mesh1 = jax.make_mesh(
        (1,), (AXIS,), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,)
    )
    codec = jc.codecs.get(spec)
    tx = jc.optax.compress_gradients(codec, AXIS)
    params = {"w": jnp.zeros((3000,), jnp.float32)}
    state = jc.optax.init(tx, params, mesh1, AXIS)
    specs = jc.optax.state_specs(state, AXIS)
    step = jax.jit(
        jax.shard_map(
            lambda g, s: tx.update(g, s),
            mesh=mesh1,
            in_specs=(P(), specs),
            out_specs=(P(), specs),
            check_vma=False,
        )
    )
    residual = jnp.zeros((3000,), jnp.float32)
    for t in range(3):
        g = {"w": 0.3 * jax.random.normal(jax.random.key(t), (3000,)) + 0.1}
        update, state = step(g, state)
        acc = g["w"] + residual
        want = codec.decode(codec.encode(acc))
        residual = acc - want
        assert np.asarray(update["w"]).tobytes() == np.asarray(want).tobytes(), t
        (cs,) = [x for x in state if isinstance(x, jc.optax.CompressState)] or [state]
        got_residual = np.asarray(cs.residuals["w"]).reshape(-1)
        assert got_residual.tobytes() == np.asarray(residual).tobytes(), t


def test_without_error_feedback_the_sum_is_not_conserved(mesh):
    # The same check fails when nothing carries the compression error: it
    # can tell a lossy transformation from a conserving one.
    assert conservation_error(mesh, jc.codecs.OneBit(), 100, error_feedback=False) > 1e-2


def test_hierarchical_axes_conserve(mesh):
    mesh2 = jax.make_mesh((2, 4), ("node", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    axes = ("node", "local")
    codec = jc.codecs.QSGD(bits=4)
    tx = jc.optax.compress_gradients(
        codec, axes, min_compress_size=512, fusion_bytes=6000, residual_norm=True
    )
    state = jc.optax.init(tx, params0(), mesh2, axes)
    specs = jc.optax.state_specs(state, axes)
    assert specs.residuals == {k: P(axes) for k in SHAPES}

    def body(state):
        d = lax.axis_index(axes)

        def one(state, t):
            u, state = tx.update(grads_at(t, d), state)
            return state, u

        return lax.scan(one, state, jnp.arange(200))

    f = jax.shard_map(body, mesh=mesh2, in_specs=(specs,), out_specs=(specs, P()), check_vma=False)
    state, updates = jax.jit(f)(state)
    res = residual_leaves(state)
    ref = reference_grad_sum(200)
    for k in ref:
        got = N_DEV * np.asarray(updates[k], np.float64).sum(0) + res[k].sum(0)
        np.testing.assert_allclose(got, ref[k], rtol=0, atol=1e-5 * np.abs(ref[k]).max())
    # float32 over the fast axis, compressed over the slow one
    n = 3800
    tel = jc.optax.telemetry(state)
    assert float(tel["wire_bytes"]) > 2 * 3 / 4 * 4 * n
    # asked for, the residual norm covers every device of both axes
    norm = np.sqrt(sum(float(np.sum(v**2)) for v in res.values()))
    assert norm > 0 and float(tel["residual_norm"]) == pytest.approx(norm, rel=1e-5)


def test_bfloat16_gradients_and_residuals(mesh):
    codec = jc.codecs.Int8(bucket_size=64)
    params = {"a": jnp.zeros((40, 50), jnp.bfloat16), "c": jnp.zeros(1500)}
    tx = jc.optax.compress_gradients(codec, AXIS, min_compress_size=512, residual_dtype="bfloat16")
    plan = jc.optax.make_plan(codec, params, min_compress_size=512, fusion_bytes=1 << 20)
    assert [(b.dtype.name, b.size) for b in plan.buckets] == [("bfloat16", 2000), ("float32", 1500)]
    g = device_grads()
    grads = {"a": g["a"].astype(jnp.bfloat16), "c": g["c"]}
    updates, state = run_once(mesh, tx, params, grads)
    assert updates["a"].dtype == jnp.bfloat16 and updates["c"].dtype == jnp.float32
    assert [r.dtype for r in jax.tree.leaves(state.residuals)] == [jnp.bfloat16, jnp.bfloat16]
    exact = exact_mean(jax.tree.map(lambda a: a.astype(jnp.float32), grads))
    for k in ("a", "c"):  # Int8: each device off by at most max|x|/254 per bucket
        err = np.abs(np.asarray(updates[k], np.float32) - np.asarray(exact[k]))
        assert err.max() <= 0.02 * np.abs(np.asarray(g[k])).max()


# ---------------------------------------------------------------------------
# The state: residuals shaped like the parameters
# ---------------------------------------------------------------------------
def _is_masked(x):
    return isinstance(x, optax.MaskedNode)


def test_residuals_are_shaped_like_the_parameters(mesh):
    params = {
        "layer": {"w": jnp.zeros((40, 50)), "b": jnp.zeros(300)},
        "emb": jnp.zeros((64, 16), jnp.bfloat16),
        "scale": jnp.zeros(()),
        "count": jnp.zeros(3, jnp.int32),  # float0 gradient
        "z": jnp.zeros(4, jnp.complex64),  # always sent exactly
    }

    def layout(tree):
        return jax.tree.map(lambda r: (r.shape, r.dtype.name), tree)

    tx = jc.optax.compress_gradients(jc.codecs.QSGD(bits=4), AXIS, min_compress_size=512)
    res = jax.eval_shape(tx.init, params).residuals
    assert jax.tree.structure(res, is_leaf=_is_masked) == jax.tree.structure(params)
    # Every floating-point leaf: residual_dtype[1, *shape] (this device's
    # row), compressed or not; the others a placeholder.
    assert layout(res) == {
        "layer": {"w": ((1, 40, 50), "float32"), "b": ((1, 300), "float32")},
        "emb": ((1, 64, 16), "float32"),
        "scale": ((1,), "float32"),
        "count": optax.MaskedNode(),
        "z": optax.MaskedNode(),
    }
    # Neither fusion nor the policy changes the state.
    policy = {
        "layer": {"w": jc.codecs.Int8(), "b": None},
        "emb": jc.codecs.QSGD(bits=2),
        "scale": None,
        "count": None,
        "z": None,
    }
    other = jc.optax.compress_gradients(policy, AXIS, fusion_bytes=1, min_compress_size=0)
    assert layout(jax.eval_shape(other.init, params).residuals) == layout(res)

    # On the mesh: [devices, *shape], sharded over the data axis; a step
    # keeps the layout and passes the float0 gradient through.
    state = jc.optax.init(tx, params, mesh, AXIS)
    specs = jc.optax.state_specs(state, AXIS)
    assert jax.tree.map(lambda r: (r.shape, r.sharding.spec), state.residuals) == {
        "layer": {"w": ((N_DEV, 40, 50), P(AXIS)), "b": ((N_DEV, 300), P(AXIS))},
        "emb": ((N_DEV, 64, 16), P(AXIS)),
        "scale": ((N_DEV,), P(AXIS)),
        "count": optax.MaskedNode(),
        "z": optax.MaskedNode(),
    }

    def step(params, state):
        loss = lambda p: sum(  # noqa: E731
            jnp.sum(jnp.abs(x.astype(jnp.complex64)) ** 2 * (1 + lax.axis_index(AXIS)))
            for x in jax.tree.leaves(p)
        )
        updates, state = tx.update(jax.grad(loss, allow_int=True)(params), state)
        assert updates["count"].dtype == jax.dtypes.float0
        return state

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), specs), out_specs=specs, check_vma=False)
    after = jax.jit(f)(jax.tree.map(lambda p: p + 1, params), state)
    assert layout(after.residuals) == layout(state.residuals)
    assert int(after.step) == 1


def test_a_non_finite_step_leaves_the_state_as_it_was(mesh):
    tx = make_tx(jc.codecs.QSGD(bits=4), residual_dtype="float16")
    state0 = jc.optax.init(tx, params0(), mesh, AXIS)
    step = jax.jit(mapped_update(mesh, tx, jc.optax.state_specs(state0, AXIS)))
    _, state1 = step(device_grads(0), state0)
    kept = state1._replace(telemetry=None)

    # A NaN on one device: the mean shows it, and no device's state moves.
    g = device_grads(1)
    nan = g | {"a": g["a"].at[3, 0, 0].set(jnp.nan)}
    updates, state2 = step(nan, state1)
    assert np.isnan(np.asarray(updates["a"])).any()
    assert_trees_equal(state2._replace(telemetry=None), kept)
    # ... so the next step is the one that would have come; the telemetry
    # counts the skipped step.
    _, after = step(g, state2)
    want = step(g, state1)[1]
    assert int(after.telemetry.skipped_steps) == 1 and int(want.telemetry.skipped_steps) == 0
    skipped = want.telemetry._replace(skipped_steps=after.telemetry.skipped_steps)
    assert_trees_equal(after, want._replace(telemetry=skipped))

    # A residual past float16's range on device 0 only: the mean is finite,
    # the step counts, and the elements of device 0's residual that would
    # overflow keep their old values; every other element moves on.
    big = g | {"c": g["c"].at[0].multiply(1e6)}
    updates, state3 = step(big, state1)
    assert all(np.isfinite(np.asarray(u)).all() for u in updates.values())
    assert int(state3.step) == 2
    for k in SHAPES:
        new, old = np.asarray(state3.residuals[k]), np.asarray(state1.residuals[k])
        assert np.isfinite(new).all()
        assert k == "b" or not np.array_equal(new[1:], old[1:])  # 'b' is sent exactly
        if k != "c":
            continue
        kept = new[0] == old[0]
        assert kept.any() and not kept.all()  # the overflowing elements only


@pytest.mark.parametrize("case", ["structure", "buckets", "shapes", "dtype", "replicated"])
def test_a_state_that_does_not_fit_is_rejected(mesh, case):
    tx = make_tx(jc.codecs.QSGD(bits=4))
    params = params0()
    init_tx, init_params, specs = tx, params, None
    if case == "structure":
        init_params = {k: params[k] for k in ("a", "c")}
        match = "do not have the gradients' structure"
    elif case == "shapes":
        init_params = params | {"a": jnp.zeros((20, 100))}
        match = (
            r"residual for \['a'\] has shape \(1, 20, 100\), but the gradient has shape \(40, 50\)"
        )
    elif case == "dtype":
        init_tx = make_tx(jc.codecs.QSGD(bits=4), residual_dtype="bfloat16")
        match = "has dtype bfloat16, but residual_dtype is float32"
    state = jax.eval_shape(lambda p: jc.optax.init(init_tx, p, mesh, AXIS), init_params)
    if case == "buckets":  # one residual per fused bucket, as states once were
        rows = (jax.ShapeDtypeStruct((N_DEV, n), jnp.float32) for n in (2000, 1500))
        state = state._replace(residuals=tuple(rows))
        match = "one array per fused bucket"
    if case == "replicated":
        specs = jax.tree.map(lambda _: P(), state)
        match = r"the per-device state was passed as replicated.*jc\.optax\.state_specs"
    f = mapped_update(mesh, tx, specs or jc.optax.state_specs(state, AXIS))
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(f, device_grads(), state)


# ---------------------------------------------------------------------------
# The fusion plan
# ---------------------------------------------------------------------------
def test_plan_buckets_by_codec_dtype_and_size():
    q, i8 = jc.codecs.QSGD(bits=4), jc.codecs.Int8()
    tree = {
        "w0": jax.ShapeDtypeStruct((1000,), jnp.float32),
        "w1": jax.ShapeDtypeStruct((1000,), jnp.float32),
        "w2": jax.ShapeDtypeStruct((1000,), jnp.float32),
        "h": jax.ShapeDtypeStruct((2000,), jnp.bfloat16),
        "e": jax.ShapeDtypeStruct((5000,), jnp.float32),
        "bias": jax.ShapeDtypeStruct((10,), jnp.float32),
        "n": jax.ShapeDtypeStruct((20,), jnp.bfloat16),
    }

    def policy(path, leaf):
        return i8 if jax.tree_util.keystr(path) == "['e']" else q

    plan = jc.optax.make_plan(policy, tree, min_compress_size=100, fusion_bytes=8000)
    names = sorted(tree)  # ['bias', 'e', 'h', 'n', 'w0', 'w1', 'w2']
    got = [(b.codec, b.dtype.name, [names[i] for i in b.leaves]) for b in plan.buckets]
    assert got == [
        (i8, "float32", ["e"]),  # larger than fusion_bytes: a bucket of its own
        (q, "bfloat16", ["h"]),
        (q, "float32", ["w0", "w1"]),  # 8000 bytes fit, a third leaf would not
        (q, "float32", ["w2"]),
    ]
    exact = {d.name: [names[i] for i in ix] for d, ix in plan.exact}
    assert exact == {"float32": ["bias"], "bfloat16": ["n"]}


def _count_collectives(hlo: str) -> dict[str, int]:
    kinds = ["all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter"]
    return {k: len(re.findall(rf"= [^=]*?\b{k}(-start)?\(", hlo)) for k in kinds}


def test_state_specs_refuses_a_state_without_compression(mesh):
    """A state with no compress state inside would get P() everywhere, and
    per-device residuals hidden in it would pass as replicated: refused."""
    tx = optax.adam(1e-3)
    state = jc.optax.init(tx, params0(), mesh, AXIS)  # init: replicated, fine
    with pytest.raises(ValueError, match=r"no jc\.optax\.compress_gradients"):
        jc.optax.state_specs(state, AXIS)
    wrapped = {"opt_state": [np.zeros(3)]}  # e.g. leaves wrapped by a framework
    with pytest.raises(ValueError, match="optax state itself"):
        jc.optax.state_specs(wrapped, AXIS)


def test_codec_given_as_spec_string_or_class():
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((4096,))}
    kw = dict(min_compress_size=1024, fusion_bytes=1 << 20)
    want = make_plan(jc.codecs.QSGD(bits=4), params, **kw)
    assert make_plan("qsgd:bits=4", params, **kw) == want
    assert make_plan(jc.codecs.QSGD, params, **kw) == want
    assert make_plan({"w": "qsgd:bits=4", "b": jc.codecs.QSGD}, params, **kw) == want
    assert make_plan(lambda path, leaf: "qsgd:bits=4", params, **kw) == want
    # Wrong forms say what is expected, at construction where they can.
    with pytest.raises(ValueError, match="unknown codec 'qsgd4'"):
        jc.optax.compress_gradients("qsgd4", AXIS)
    with pytest.raises(TypeError, match="spec string"):
        make_plan(4, params, **kw)
    with pytest.raises(TypeError, match="spec string"):
        make_plan({"w": 4, "b": None}, params, **kw)
    with pytest.raises(TypeError, match="spec string"):
        make_plan(lambda path, leaf: 4, params, **kw)


def test_fusion_issues_few_collectives(mesh):
    codec = jc.codecs.QSGD(bits=4)
    params = {f"w{i}": jnp.zeros((64, 32)) for i in range(12)}
    params |= {f"b{i}": jnp.zeros((32,)) for i in range(12)}
    grads = jax.tree.map(lambda p: jnp.ones((N_DEV, *p.shape)), params)

    def lowered(fusion_bytes, **kw):
        tx = jc.optax.compress_gradients(codec, AXIS, fusion_bytes=fusion_bytes, **kw)
        state = jax.eval_shape(lambda p: jc.optax.init(tx, p, mesh, AXIS), params)
        return jax.jit(mapped_update(mesh, tx, jc.optax.state_specs(state, AXIS))).lower(
            grads, state
        )

    def compiled_counts(module, fusion_bytes):
        hlo = module.compile().as_text()
        plan = jc.optax.make_plan(codec, params, min_compress_size=1024, fusion_bytes=fusion_bytes)
        return _count_collectives(hlo), len(plan.buckets)

    default = lowered(64 << 20)
    fused, n_buckets = compiled_counts(default, 64 << 20)
    assert n_buckets == 1
    # two-phase: one all-to-all and one all-gather (a payload's arrays
    # travel as one buffer); one all-reduce for the 12 biases, and none for
    # the telemetry by default.
    assert fused["all-to-all"] <= 1 and fused["all-gather"] <= 1
    assert fused["all-reduce"] == 1
    assert sum(fused.values()) <= 3

    # The residual norm, when asked for, is one more (scalar) all-reduce.
    def all_reduces(module):
        return len(re.findall(r"stablehlo\.all_reduce", module.as_text()))

    with_norm = lowered(64 << 20, residual_norm=True)
    assert all_reduces(with_norm) == all_reduces(default) + 1
    unfused, n_buckets = compiled_counts(lowered(1), 1)
    assert n_buckets == 12
    assert sum(unfused.values()) >= 12  # a collective per bucket at least


_COLLECTIVE = re.compile(
    r"\b(all-gather|all-to-all|all-reduce|collective-permute|reduce-scatter)(-start)?\("
)


def _entry_collectives(hlo: str) -> tuple[list[str], set[str], callable]:
    """The top-level collectives of a compiled module and its conditionals
    that hold collectives, in text order; the set of those conditionals; and
    ``depends(a, b)``: whether instruction a reads b's result (transitively)."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    operands, found, conditionals = {}, [], set()
    for line in bodies["ENTRY"]:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
        if not m:
            continue
        rhs = m.group(2).split(", metadata=")[0]
        operands[m.group(1)] = re.findall(r"%([\w.\-]+)", rhs)
        branches = re.findall(r"branch_computations=\{([^}]*)\}", rhs)
        nested = [b.strip().lstrip("%") for b in branches[0].split(",")] if branches else []
        if any(_COLLECTIVE.search(x) for b in nested for x in bodies.get(b, [])):
            found.append(m.group(1))
            conditionals.add(m.group(1))
        elif _COLLECTIVE.search(rhs.split("(")[0] + "("):
            found.append(m.group(1))

    def depends(a, b):
        seen, stack = set(), [a]
        while stack:
            x = stack.pop()
            if x == b:
                return True
            if x not in seen:
                seen.add(x)
                stack += operands.get(x, [])
        return False

    return found, conditionals, depends


@pytest.mark.parametrize(
    "codec, algorithm, hierarchical, warmup_steps",
    [
        # collectives in conditionals: capacity tiers, SparCML's split tiers, the warm-up
        (jc.codecs.ThreeLC(), "hierarchical", True, 0),
        (jc.codecs.TopK(fraction=0.1), "sparse", False, 0),
        (jc.codecs.QSGD(bits=4), "auto", False, 2),
    ],
    ids=["ThreeLC-hierarchical", "TopK-sparse", "QSGD-warmup"],
)
def test_a_step_enters_its_collectives_in_one_order(
    mesh, mesh2d, codec, algorithm, hierarchical, warmup_steps
):
    """XLA:CPU orders its top-level collectives among themselves, but not
    against those nested in a conditional (capacity tiers, the warm-up);
    two buckets' collectives entered in different orders by different
    devices deadlocked the process (aborted by XLA's rendezvous timeout,
    under load). The step chains them by data: every conditional that holds
    collectives comes after, or before, each other collective."""
    m, axes = (mesh2d, HIER) if hierarchical else (mesh, AXIS)
    tx = make_tx(codec, axes, algorithm=algorithm, warmup_steps=warmup_steps)
    state = jax.eval_shape(lambda p: jc.optax.init(tx, p, m, axes), params0())  # only compiled
    specs = jc.optax.state_specs(state, axes)

    def step(state):
        return tx.update(grads_at(0, lax.axis_index(axes)), state)

    f = jax.shard_map(step, mesh=m, in_specs=(specs,), out_specs=(P(), specs), check_vma=False)
    found, conditionals, depends = _entry_collectives(jax.jit(f).lower(state).compile().as_text())
    assert conditionals and len(found) > len(conditionals), found
    loose = [
        (c, x)
        for c in conditionals
        for x in found
        if x != c and not (depends(c, x) or depends(x, c))
    ]
    assert not loose, loose


# ---------------------------------------------------------------------------
# Policy
# ---------------------------------------------------------------------------
def run_once(mesh, tx, params, grads):
    """One update on every device; grads has a leading device axis."""
    state = jc.optax.init(tx, params, mesh, AXIS)
    return jax.jit(mapped_update(mesh, tx, jc.optax.state_specs(state, AXIS)))(grads, state)


def exact_mean(grads):
    """The exact mean over the leading device axis (float64, as float32)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64).mean(0).astype(np.float32), grads)


@jax.jit
def _device_grads(t):
    return jax.vmap(lambda d: grads_at(t, d))(jnp.arange(N_DEV))


def device_grads(seed=0):
    """Every device's gradients at step ``seed`` (a leading device axis),
    from one jitted program compiled once for all steps."""
    return _device_grads(seed)


@pytest.mark.parametrize("form", ["callable", "pytree"])
def test_policy_selects_codecs_per_leaf(mesh, form):
    q = jc.codecs.QSGD(bits=2, bucket_size=512)
    if form == "callable":

        def policy(path, leaf):
            return None if jax.tree_util.keystr(path) == "['c']" else q
    else:
        policy = {"a": q, "b": q, "c": None}
    tx = jc.optax.compress_gradients(policy, AXIS, min_compress_size=100)
    grads = device_grads()
    updates, state = run_once(mesh, tx, params0(), grads)
    exact = exact_mean(grads)
    # 'c' is averaged exactly, 'a' and 'b' are compressed (2-bit QSGD is far off)
    np.testing.assert_allclose(updates["c"], exact["c"], rtol=1e-6, atol=1e-6)
    for k in ("a", "b"):
        assert not np.allclose(updates[k], exact[k], rtol=1e-2, atol=1e-2)
    assert jax.tree.map(jnp.shape, state.residuals) == {k: (N_DEV, *s) for k, s in SHAPES.items()}


def test_policy_pytree_must_match_the_gradients(mesh):
    q = jc.codecs.QSGD(bits=4)
    tx = jc.optax.compress_gradients({"a": q, "c": None}, AXIS)
    with pytest.raises(ValueError, match="codec pytree does not match the gradients"):
        tx.init(params0())


def test_integer_gradient_is_rejected():
    # An integer parameter is fine (its gradient is float0, passed through);
    # an integer gradient cannot be averaged, with a codec or without.
    params = {"w": jnp.zeros(100), "i": jnp.zeros(100, jnp.int32)}
    tx = jc.optax.compress_gradients(jc.codecs.QSGD(bits=4), AXIS, min_compress_size=10)
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"cannot carry gradient \['i'\] of dtype int32"):
        tx.update(params, state)
    tx = jc.optax.compress_gradients(
        lambda path, leaf: (
            None if jax.tree_util.keystr(path) == "['i']" else jc.codecs.QSGD(bits=4)
        ),
        AXIS,
        min_compress_size=10,
    )
    with pytest.raises(TypeError, match=r"gradient \['i'\] has dtype int32"):
        tx.update(params, tx.init(params))


# ---------------------------------------------------------------------------
# Warm-up and telemetry
# ---------------------------------------------------------------------------
def test_warmup_steps_send_the_exact_mean_and_leave_no_residual(mesh):
    tx = make_tx(jc.codecs.OneBit(), warmup_steps=3, residual_norm=True, algorithm="two_phase")
    state, updates, tel = scan_updates(mesh, tx, 5)
    for t in range(5):
        grads = jax.vmap(lambda d, t=t: grads_at(t, d))(jnp.arange(N_DEV))
        exact = exact_mean(grads)
        close = all(np.allclose(updates[k][t], exact[k], rtol=1e-6, atol=1e-6) for k in ("a", "c"))
        assert close == (t < 3), f"step {t}"
        np.testing.assert_allclose(updates["b"][t], exact["b"], rtol=1e-6, atol=1e-6)
        # warm-up steps send every leaf at full width and leave no residual
        warm = (float(tel["bits_per_element"][t]), float(tel["compression_ratio"][t]))
        assert (warm == (32.0, pytest.approx(1.0))) == (t < 3), f"step {t}"
        assert (float(tel["residual_norm"][t]) == 0.0) == (t < 3), f"step {t}"
    assert int(state.step) == 5 and float(tel["compression_ratio"][4]) > 5


@pytest.mark.parametrize(
    ("codec", "algorithm"),
    [
        (jc.codecs.QSGD(bits=4), "allgather"),
        (jc.codecs.QSGD(bits=4), "two_phase"),
        (jc.codecs.QSGD(bits=4), "ring"),
        (jc.codecs.Identity(), "allreduce"),  # a linear codec: a psum of payloads
    ],
    ids=lambda v: v if isinstance(v, str) else codec_id(v),
)
def test_telemetry_values(mesh, codec, algorithm):
    tx = make_tx(codec, algorithm=algorithm)
    state, _, _ = scan_updates(mesh, tx, 3)
    tel = jc.optax.telemetry(state)
    plan = jc.optax.make_plan(codec, params0(), min_compress_size=512, fusion_bytes=6000)
    assert [b.size for b in plan.buckets] == [2000, 1500]
    n = 2000 + 300 + 1500
    payload = sum(codec.wire_nbytes((b.size,), jnp.float32) for b in plan.buckets)
    assert float(tel["bits_per_element"]) == pytest.approx(8 * (payload + 4 * 300) / n, rel=1e-6)
    sent = 2 * (N_DEV - 1) / N_DEV * 4 * 300  # the uncompressed bias: ring all-reduce
    for b in plan.buckets:
        ops = jc.collectives.operand_nbytes(codec, (b.size,), jnp.float32, N_DEV, algorithm)
        if algorithm == "allgather":
            sent += (N_DEV - 1) * ops["all-gather"]
        elif algorithm == "two_phase":
            sent += (N_DEV - 1) / N_DEV * ops["all-to-all"] + (N_DEV - 1) * ops["all-gather"]
        elif algorithm == "allreduce":
            sent += 2 * (N_DEV - 1) / N_DEV * ops["all-reduce"]
        else:
            sent += ops["collective-permute"]
    assert float(tel["wire_bytes"]) == pytest.approx(sent, rel=1e-6)
    baseline = 2 * (N_DEV - 1) / N_DEV * 4 * n
    assert float(tel["compression_ratio"]) == pytest.approx(baseline / sent, rel=1e-6)
    assert float(tel["residual_norm"]) == 0.0  # not computed unless asked for
    assert int(tel["step"]) == 3


# ---------------------------------------------------------------------------
# pmap and shard_map; checkpoints; optax wrappers
# ---------------------------------------------------------------------------
def sgd_chain(codec=None):
    codec = codec or jc.codecs.QSGD(bits=4, bucket_size=128)
    return optax.chain(make_tx(codec), optax.sgd(0.05, momentum=0.9))


def train_step(tx):
    def step(params, state, g):
        updates, state = tx.update(jax.tree.map(lambda a: a[0], g), state, params)
        return optax.apply_updates(params, updates), state

    return step


_STEPS: dict = {}


def shard_map_steps(mesh, tx, params, state, grads_list):
    specs = jc.optax.state_specs(state, AXIS)
    if id(tx) not in _STEPS:  # one jitted step per optimizer (keeps tx alive)
        f = jax.jit(
            jax.shard_map(
                train_step(tx),
                mesh=mesh,
                in_specs=(P(), specs, P(AXIS)),
                out_specs=(P(), specs),
                check_vma=False,
            )
        )
        _STEPS[id(tx)] = (tx, f)
    f = _STEPS[id(tx)][1]
    for g in grads_list:
        params, state = f(params, state, g)
    return params, state


def pmap_steps(tx, params, grads_list):
    params = jax.tree.map(lambda a: jnp.stack([a] * N_DEV), params)
    state = jax.pmap(tx.init, axis_name=AXIS)(params)
    f = jax.pmap(train_step(tx), axis_name=AXIS)
    for g in grads_list:
        g = jax.tree.map(lambda a: a[:, None], g)  # [devices, 1, ...]: the same step code
        params, state = f(params, state, g)
    return params, state


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_pmap_and_shard_map_agree(mesh):
    tx = sgd_chain()
    grads_list = [device_grads(t) for t in range(3)]
    p_sm, s_sm = shard_map_steps(
        mesh, tx, params0(), jc.optax.init(tx, params0(), mesh, AXIS), grads_list
    )
    p_pm, s_pm = pmap_steps(tx, params0(), grads_list)
    for d in range(N_DEV):
        assert_trees_equal(p_sm, jax.tree.map(lambda a, d=d: a[d], p_pm))
    # per-device residuals: row d of the shard_map state is device d's
    for k, r_pm in s_pm[0].residuals.items():
        assert r_pm.shape == (N_DEV, 1, *SHAPES[k])
        np.testing.assert_array_equal(np.asarray(s_sm[0].residuals[k]), np.asarray(r_pm)[:, 0])
    tel_sm, tel_pm = jc.optax.telemetry(s_sm), jc.optax.telemetry(s_pm)
    for k in tel_sm:
        np.testing.assert_array_equal(np.asarray(tel_pm[k]), np.full(N_DEV, tel_sm[k]))


def test_orbax_checkpoint_restores_bit_identically_and_carries_over_to_another_layout(
    mesh, tmp_path
):
    ocp = pytest.importorskip("orbax.checkpoint")
    codec = jc.codecs.QSGD(bits=4, bucket_size=128)  # stochastic: the key must survive too

    def chain(tx):  # sgd(1): the parameters are minus the sum of the applied updates
        return optax.chain(tx, optax.sgd(1.0))

    tx = chain(make_tx(codec, fusion_bytes=1 << 20))
    grads_list = [device_grads(t) for t in range(6)]
    state0 = jc.optax.init(tx, params0(), mesh, AXIS)
    params, state = shard_map_steps(mesh, tx, params0(), state0, grads_list[:3])
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    ckpt.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": state})
    saved = residual_leaves(state[0])
    assert not saved["b"].any() and saved["a"].any() and saved["c"].any()  # 'b' was sent exactly
    p_a, s_a = shard_map_steps(mesh, tx, params, state, grads_list[3:])

    others = {
        "same": tx,
        "fusion": chain(make_tx(codec, fusion_bytes=6000)),  # 'a' and 'c' apart
        "policy": chain(
            jc.optax.compress_gradients(
                {"a": jc.codecs.Int8(), "b": codec, "c": None}, AXIS, min_compress_size=100
            )
        ),
    }
    saved_server = server_leaves(state[0], codec, fusion_bytes=1 << 20)
    assert any(v.any() for v in saved_server.values())
    for name, other in others.items():
        restored = ckpt.restore(tmp_path / "ckpt", target)
        r_state = restored["opt_state"]
        assert r_state[0].residuals["a"].sharding.spec == P(AXIS)
        assert r_state[0].server_residuals[0].sharding.spec == P(AXIS)
        for k, r in residual_leaves(r_state).items():
            np.testing.assert_array_equal(r, saved[k], err_msg=f"{name}: {k}")
        if name == "same":
            p_b, s_b = shard_map_steps(mesh, other, restored["params"], r_state, grads_list[3:])
            assert_trees_equal(p_a, p_b)
            assert_trees_equal(s_a, s_b)
            continue
        # Another layout: the server residuals (per fused bucket) do not fit
        # it, and the step says so; the per-leaf residuals, step and key
        # carry over into a fresh state, whose server residuals start at
        # zero (what the old ones held back is then dropped: counted below).
        with pytest.raises(ValueError, match="server residual"):
            shard_map_steps(mesh, other, restored["params"], r_state, grads_list[3:4])
        _STEPS.pop(id(other))  # its step was built for the old state's layout
        fresh = jc.optax.init(other, params0(), mesh, AXIS)
        old = r_state[0]
        carried = (
            fresh[0]._replace(step=old.step, key=old.key, residuals=old.residuals),
            *fresh[1:],
        )
        p_b, s_b = shard_map_steps(mesh, other, restored["params"], carried, grads_list[3:])
        assert int(jc.optax.telemetry(s_b)["step"]) == 6
        assert all(np.isfinite(np.asarray(v)).all() for v in p_b.values())
        applied = {k: -np.asarray(v, np.float64) for k, v in p_b.items()}
        other_policy, kw = codec, {"fusion_bytes": 6000}
        if name == "policy":
            other_policy = {"a": jc.codecs.Int8(), "b": codec, "c": None}
            kw = {"fusion_bytes": 64 << 20, "min_compress_size": 100}
        held = {
            k: saved_server[k] + v for k, v in server_leaves(s_b[0], other_policy, **kw).items()
        }
        assert conservation_gap(applied, s_b, 6, held) < 1e-5, name
        if name == "policy":  # sent exactly now: its residual went out with it
            assert not residual_leaves(s_b)["c"].any()


def test_inject_hyperparams_around_the_chain(mesh):
    def make(learning_rate):
        return optax.chain(make_tx(jc.codecs.Int8()), optax.sgd(learning_rate))

    tx = optax.inject_hyperparams(make)(learning_rate=0.1)
    state = jc.optax.init(tx, params0(), mesh, AXIS)
    p1, s1 = shard_map_steps(mesh, tx, params0(), state, [device_grads(0)])
    state2 = state._replace(hyperparams={"learning_rate": jnp.asarray(0.2)})
    p2, _ = shard_map_steps(mesh, tx, params0(), state2, [device_grads(0)])
    np.testing.assert_allclose(p2["a"], 2 * p1["a"], rtol=1e-6)
    assert int(jc.optax.telemetry(s1)["step"]) == 1


def test_inject_hyperparams_warmup_steps(mesh):
    static = ("fusion_bytes", "min_compress_size")
    tx = optax.inject_hyperparams(jc.optax.compress_gradients, static_args=static)(
        codec=jc.codecs.OneBit(),
        axis_name=AXIS,
        fusion_bytes=6000,
        min_compress_size=512,
        warmup_steps=1,
    )
    state = jc.optax.init(tx, params0(), mesh, AXIS)
    g = device_grads(0)
    f = jax.jit(mapped_update(mesh, tx, jc.optax.state_specs(state, AXIS)))
    exact = exact_mean(g)
    u1, s1 = f(g, state)  # step 0 < warmup_steps=1: exact
    np.testing.assert_allclose(u1["a"], exact["a"], rtol=1e-6, atol=1e-6)
    hyperparams = dict(
        state.hyperparams, warmup_steps=jnp.zeros_like(state.hyperparams["warmup_steps"])
    )
    u2, _ = f(g, state._replace(hyperparams=hyperparams))
    assert not np.allclose(u2["a"], exact["a"], rtol=1e-3, atol=1e-3)
    assert float(jc.optax.telemetry(s1)["bits_per_element"]) == 32.0

    # Left at their None defaults, the structural ints need no static_args.
    plain = optax.inject_hyperparams(jc.optax.compress_gradients)(
        codec=jc.codecs.OneBit(), axis_name=AXIS, warmup_steps=1
    )
    assert set(plain.init(params0()).hyperparams) == {"warmup_steps", "seed"}
    with pytest.raises(ValueError, match="static_args"):
        optax.inject_hyperparams(jc.optax.compress_gradients)(
            codec=jc.codecs.OneBit(), axis_name=AXIS, fusion_bytes=6000
        ).init(params0())


def test_multisteps(mesh):
    inner = sgd_chain(jc.codecs.Int8(bucket_size=64))
    tx = optax.MultiSteps(inner, every_k_schedule=2)
    state = jc.optax.init(tx, params0(), mesh, AXIS)
    specs = jc.optax.state_specs(state, AXIS)
    assert specs.acc_grads == {"a": P(AXIS), "b": P(AXIS), "c": P(AXIS)}
    assert state.acc_grads["a"].shape == (N_DEV * 40, 50)
    grads_list = [device_grads(t) for t in range(4)]
    p_sm, s_sm = shard_map_steps(mesh, tx, params0(), state, grads_list)
    assert int(jc.optax.telemetry(s_sm)["step"]) == 2  # one communication per 2 micro-steps
    # The same as the inner chain on the per-device mean of each pair of micro-steps.
    pairs = [
        jax.tree.map(lambda x, y: (x + y) / 2, grads_list[i], grads_list[i + 1]) for i in (0, 2)
    ]
    p_ref, _ = shard_map_steps(
        mesh, inner, params0(), jc.optax.init(inner, params0(), mesh, AXIS), pairs
    )
    for k in p_ref:
        np.testing.assert_allclose(p_sm[k], p_ref[k], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Misuse
# ---------------------------------------------------------------------------
def test_update_outside_a_mapped_step():
    tx = make_tx(jc.codecs.QSGD(bits=4))
    state = tx.init(params0())
    with pytest.raises(
        ValueError, match=r"inside jax\.shard_map or jax\.pmap over the axis 'data'"
    ):
        tx.update(params0(), state)


def test_update_with_an_unbound_axis_name(mesh):
    tx = jc.optax.compress_gradients(jc.codecs.QSGD(bits=4), "batch")
    state = jc.optax.init(tx, params0(), mesh, AXIS)
    f = mapped_update(mesh, tx, jc.optax.state_specs(state, AXIS))
    with pytest.raises(ValueError, match="axis 'batch', which is not bound here") as e:
        jax.jit(f)(device_grads(), state)
    # It names the axes that are bound (where this JAX says which they are).
    from jaxcomp._axes import bound_axes

    if bound_axes() is not None:
        assert "The axes bound here are 'data' (size 8)" in str(e.value)


def test_replicated_out_specs_rejected_by_vma_checking(mesh):
    tx = make_tx(jc.codecs.QSGD(bits=4))
    state = jc.optax.init(tx, params0(), mesh, AXIS)
    specs = jc.optax.state_specs(state, AXIS)

    def step(g, s):
        _, s = tx.update(jax.tree.map(lambda a: a[0], g), s)
        return s.residuals

    f = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(AXIS), specs),
        out_specs=P(),  # a per-device residual declared replicated
    )
    with pytest.raises(Exception, match=r"(?i)vary|varying|replicat"):
        jax.jit(f)(device_grads(), state)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(fusion_bytes=0), "fusion_bytes must be a Python int >= 1"),
        (dict(min_compress_size=-1), "min_compress_size must be a Python int >= 0"),
        (dict(algorithm="tree"), "algorithm must be one of"),
        (dict(warmup_steps=-2), "warmup_steps must be >= 0"),
        (dict(residual_dtype=jnp.int32), "residual_dtype must be a floating dtype"),
    ],
)
def test_bad_configuration(kw, match):
    with pytest.raises(ValueError, match=match):
        jc.optax.compress_gradients(jc.codecs.QSGD(bits=4), AXIS, **kw)


def test_telemetry_needs_a_compress_state():
    with pytest.raises(
        ValueError, match=r"no jc\.optax\.compress_gradients \(or powersgd, pmean\) state"
    ):
        jc.optax.telemetry(optax.sgd(0.1).init(params0()))


def trace_update(mesh, tx):
    """Traces (compiles and runs nothing) one update of ``tx`` on every
    device: what the step's Python does when it is staged out."""
    state = jc.optax.init(tx, params0(), mesh, AXIS)
    grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct((N_DEV, *a.shape), a.dtype), params0())
    jax.eval_shape(mapped_update(mesh, tx, jc.optax.state_specs(state, AXIS)), grads, state)


def test_unsafe_codec_and_algorithm_warn_once(mesh):
    # The warning is issued when the step is traced: tracing is enough.
    tx = make_tx(jc.codecs.TernGrad(), algorithm="two_phase")
    with pytest.warns(RuntimeWarning, match="not a contraction"):
        trace_update(mesh, tx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace_update(mesh, make_tx(jc.codecs.TernGrad(), algorithm="two_phase"))  # once
        trace_update(mesh, make_tx(jc.codecs.TernGrad()))  # auto: allgather, no warning
