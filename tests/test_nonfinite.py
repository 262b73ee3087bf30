"""Non-finite steps: a NaN or an inf in one gradient element on one device
leaves every state (residuals, server residuals, step, key, Adam's moments,
PowerSGD's Qs) as it was, so a run that met one goes on bit for bit as the
run that never got that gradient; for every codec and algorithm, with
optax.apply_if_finite after it, with bfloat16 gradients, under pmap, and for
onebit_adam and powersgd. The flag is read from the mean, identical on
every device: every device skips alike, and the step has no collective
for it."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp.collectives import all_finite

N_DEV = 8
AXIS = "data"
HIER = ("node", "local")
BAD = [np.inf, -np.inf, np.nan]


@pytest.fixture(scope="module")
def meshes():
    if len(jax.devices()) < N_DEV:
        pytest.skip(f"needs {N_DEV} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    auto = jax.sharding.AxisType.Auto
    return {
        AXIS: jax.make_mesh((N_DEV,), (AXIS,), axis_types=(auto,)),
        HIER: jax.make_mesh((4, 2), HIER, axis_types=(auto, auto)),
        # The ring's P - 1 rounds are unrolled: 4 devices compile in half the time.
        "ring": jax.make_mesh((4,), (AXIS,), axis_types=(auto,), devices=jax.devices()[:4]),
    }


# One leaf per registered codec (each its own bucket) and a small leaf sent
# exactly; the sparse algorithm carries top-k only, allreduce linear codecs.
CODECS = {name: jc.codecs.get(name) for name in jc.codecs.names()}
CODECS["topk"] = jc.codecs.TopK(fraction=0.05)
SIZE, BIAS = 2048, 100
ALGORITHMS = ["two_phase", "allgather", "ring", "hierarchical", "sparse", "allreduce"]
# The fast tier: one codec of each kind (fixed rate, variable rate, sparse)
# through two-phase, with its server residuals; the slow tier every codec
# through every algorithm that carries it.
FEW = ("qsgd", "threelc", "topk")


def leaves_for(algorithm: str, names=tuple(CODECS)) -> dict:
    """{leaf name: codec or None} of the transformation for ``algorithm``."""
    rate = {"sparse": jc.codecs.Rate.SPARSE, "allreduce": jc.codecs.Rate.LINEAR}.get(algorithm)
    chosen = {n: CODECS[n] for n in names if rate is None or CODECS[n].rate is rate}
    return {**chosen, "bias": None}


def gradients(names, steps: int, dtype=np.float32, seed: int = 0, devices=N_DEV) -> list[dict]:
    """Every step's gradients: {leaf: [devices, size]} numpy arrays."""
    rng = np.random.default_rng(seed)
    return [
        {
            n: (rng.standard_normal((devices, BIAS if n == "bias" else SIZE)) + 0.25).astype(dtype)
            for n in names
        }
        for _ in range(steps)
    ]


def inject(seq: list[dict], at: dict) -> list[dict]:
    """``seq`` with ``at[t] = (leaf, device, position, value)`` written in."""
    out = [dict(g) for g in seq]
    for t, (leaf, d, pos, value) in at.items():
        g = out[t][leaf].copy()
        g[d, pos] = value
        out[t][leaf] = g
    return out


def drop(seq: list, steps) -> list:
    return [g for t, g in enumerate(seq) if t not in steps]


def assert_trees_identical(a, b, what=""):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, what
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what} leaf {i}"
        assert x.tobytes() == y.tobytes(), f"{what} leaf {i}: {x} vs {y}"


def without_skip_count(state):
    """The state with every telemetry's skipped_steps zeroed (what differs
    between a run that met a bad step and one that did not)."""

    def fix(s):
        if isinstance(s, jc.optax.Telemetry):
            return s._replace(skipped_steps=jnp.zeros_like(s.skipped_steps))
        return s

    return jax.tree.map(fix, state, is_leaf=lambda s: isinstance(s, jc.optax.Telemetry))


def mapped_step(mesh, axis, tx, state):
    """``(grads [devices, ...], state) -> (updates, state, step per device)``
    of ``tx.update`` under shard_map; the last output has one row per
    device, to show that every device decided alike."""
    specs = jc.optax.state_specs(state, axis)
    dev = P(axis)

    def body(g, s):
        u, s = tx.update(jax.tree.map(lambda a: a[0], g), s)
        return u, s, jc.optax.telemetry(s)["step"][None]

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(dev, specs), out_specs=(P(), specs, dev), check_vma=False
        )
    )


def run(step, state, seq):
    updates, counts = [], []
    for g in seq:
        u, state, count = step(g, state)
        updates.append(u)
        counts.append(np.asarray(count))
    return updates, state, counts


def check_skipped(step, state0, seq, bad_steps, bad_seq, want=None):
    """The run of ``bad_seq`` (``seq`` with non-finite values at
    ``bad_steps``) against the run of ``seq`` without those steps (``want``:
    that run's ``run`` result, where the caller has it already): the bad
    steps return non-finite updates (or zeros) and count once each, every
    device skips them alike, and everything else is bit-identical."""
    want_updates, want_state, _ = want or run(step, state0, drop(seq, bad_steps))
    updates, state, counts = run(step, state0, bad_seq)
    for t, c in enumerate(counts):
        assert (c == c[0]).all(), f"step {t}: the devices disagree on the step count {c}"
        assert int(c[0]) == t + 1 - sum(k <= t for k in bad_steps), f"step {t}"
    for t in bad_steps:
        assert not all(np.isfinite(np.asarray(u, np.float32)).all() for u in updates[t].values())
    assert_trees_identical(drop(updates, bad_steps), want_updates, "updates")
    assert int(jc.optax.telemetry(state)["skipped_steps"]) == len(bad_steps)
    assert int(jc.optax.telemetry(want_state)["skipped_steps"]) == 0
    assert_trees_identical(without_skip_count(state), want_state, "state")


@pytest.mark.parametrize(
    "algorithm, names",
    [pytest.param("two_phase", FEW, id="two_phase-few")]
    + [
        pytest.param(
            a,
            tuple(n for n in CODECS if a != "two_phase" or n not in FEW),
            marks=pytest.mark.slow,
            id=a,
        )
        for a in ALGORITHMS
    ],
)
def test_a_bad_step_is_as_if_it_never_came(meshes, algorithm, names):
    """For every codec, a NaN or an inf on one device: once during the
    warm-up (the exact path), once after it (the compressed path)."""
    axis = HIER if algorithm == "hierarchical" else AXIS
    mesh = meshes["ring" if algorithm == "ring" else axis]
    policy = leaves_for(algorithm, names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # TernGrad through two_phase/ring
        tx = jc.optax.compress_gradients(
            policy, axis, algorithm=algorithm, warmup_steps=2, min_compress_size=1024
        )
        params = {n: jnp.zeros(BIAS if n == "bias" else SIZE) for n in policy}
        state0 = jc.optax.init(tx, params, mesh, axis)
        step = mapped_step(mesh, axis, tx, state0)
        seq = gradients(policy, 8, devices=mesh.size)
        bad_steps = (1, 4)
        want = run(step, state0, drop(seq, bad_steps))  # the same for every leaf
        for i, leaf in enumerate(policy):
            n = BIAS if leaf == "bias" else SIZE
            d, pos = i % mesh.size, (97 * i) % n
            bad = inject(
                seq, {k: (leaf, d, pos, BAD[(i + j) % 3]) for j, k in enumerate(bad_steps)}
            )
            check_skipped(step, state0, seq, bad_steps, bad, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("size", [1, 2048, 65536, 1 << 20])
def test_the_flag_sees_every_non_finite_value_at_every_size(size, dtype):
    """all_finite on one large array: a reduction by max skips NaN on the
    CPU backend past a size (a library takes the reduction over), which
    read NaN means as finite from 65,536 elements on."""
    flag = jax.jit(lambda a: all_finite([a]))
    x = jnp.linspace(-3.0, 3.0, size, dtype=dtype)
    assert bool(flag(x))
    for value in BAD:
        for pos in {0, size // 3, size - 1}:
            assert not bool(flag(x.at[pos].set(value))), (value, pos)


def test_a_bad_step_of_a_large_leaf_is_skipped(meshes):
    """The whole step, one leaf of 2^17 elements per device (the mean is
    past the size where the CPU backend's max reduction skips NaN): a NaN
    or an inf on one device leaves the state as it was."""
    mesh = meshes[AXIS]
    size = 1 << 17
    tx = jc.optax.compress_gradients(jc.codecs.Int8(), AXIS)
    params = {"w": jnp.zeros(size)}
    state0 = jc.optax.init(tx, params, mesh, AXIS)
    step = mapped_step(mesh, AXIS, tx, state0)
    rng = np.random.default_rng(3)
    seq = [{"w": rng.standard_normal((N_DEV, size)).astype(np.float32)} for _ in range(3)]
    bad = inject(seq, {1: ("w", 2, 12345, np.nan), 2: ("w", 5, 77, np.inf)})
    check_skipped(step, state0, seq, (1, 2), bad)


def test_the_check_costs_no_collective(meshes):
    """The step's collectives are those of jc.pmean on its bucket and one
    all-reduce of the exact leaves: none for the finiteness flag."""
    mesh = meshes[AXIS]
    codec = jc.codecs.QSGD(bits=4)
    tx = jc.optax.compress_gradients({"w": codec, "bias": None}, AXIS, algorithm="two_phase")
    params = {"w": jnp.zeros(SIZE), "bias": jnp.zeros(BIAS)}
    state = jc.optax.init(tx, params, mesh, AXIS)
    g = {k: jnp.zeros((N_DEV, *v.shape)) for k, v in params.items()}
    hlo = mapped_step(mesh, AXIS, tx, state).lower(g, state).compile().as_text()

    def pmean_alone(x):
        return jc.pmean(x[0], AXIS, codec, key=jax.random.key(0), algorithm="two_phase").value

    f = jax.shard_map(pmean_alone, mesh=mesh, in_specs=P(AXIS), out_specs=P(), check_vma=False)
    alone = jax.jit(f).lower(jnp.zeros((N_DEV, SIZE))).compile().as_text()

    pattern = re.compile(
        r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute)(-start)?\("
    )
    step_ops = sorted(m[1] for m in pattern.findall(hlo))
    want = sorted([m[1] for m in pattern.findall(alone)] + ["all-reduce"])
    assert step_ops == want
    assert not any(t.startswith("pred") for t, *_ in pattern.findall(hlo))


@pytest.mark.slow
def test_pmap_skip_mode_qsgd_threelc_topk():
    """The issue's setting: 8 pmap devices, compress_gradients then sgd(0.1),
    an inf on one device at step 2. With on_nonfinite="skip" the step
    applies zeros, and parameters and state go on as if step 2 had not come."""
    if len(jax.devices()) < N_DEV:
        pytest.skip(f"needs {N_DEV} devices")
    policy = {
        "q": jc.codecs.QSGD(bits=4),
        "t": jc.codecs.ThreeLC(),
        "k": jc.codecs.TopK(fraction=0.05),
        "bias": None,
    }
    tx = optax.chain(jc.optax.compress_gradients(policy, AXIS, on_nonfinite="skip"), optax.sgd(0.1))
    # Typed (float32, not weak) and laid out as the step's outputs are: the
    # step compiles once.
    params = {n: jnp.full(BIAS if n == "bias" else SIZE, 0.5, jnp.float32) for n in policy}
    repl = jax.pmap(lambda p: p, axis_name=AXIS)(
        jax.tree.map(lambda a: jnp.stack([a] * N_DEV), params)
    )
    state0 = jax.pmap(tx.init, axis_name=AXIS)(repl)

    def train(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    step = jax.pmap(train, axis_name=AXIS)

    def go(seq):
        p, s, ups = repl, state0, []
        for g in seq:
            p, s, u = step(p, s, g)
            ups.append(u)
        return p, s, ups

    seq = gradients(policy, 6)
    bad = inject(seq, {2: ("q", 3, 5, np.inf)})
    p, s, ups = go(bad)
    want_p, want_s, _ = go(drop(seq, (2,)))
    assert all((np.asarray(u) == 0).all() for u in ups[2].values())
    assert all(np.isfinite(np.asarray(u)).all() for t, u_ in enumerate(ups) for u in u_.values())
    assert_trees_identical(p, want_p, "params")
    assert (np.asarray(jc.optax.telemetry(s)["skipped_steps"]) == 1).all()
    assert_trees_identical(without_skip_count(s), want_s, "state")


def test_apply_if_finite_after_it_with_bfloat16_gradients(meshes):
    """bfloat16 parameters and gradients, optax.apply_if_finite after
    compress_gradients (where it sees the mean, the same on every device):
    the overflowing steps are not applied, counted by both, and the run goes
    on bit for bit as the run without them."""
    mesh = meshes[AXIS]
    policy = {"q": jc.codecs.QSGD(bits=4), "bias": None}
    tx = optax.chain(
        jc.optax.compress_gradients(policy, AXIS),
        optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), max_consecutive_errors=3),
    )
    params = {n: jnp.full(BIAS if n == "bias" else SIZE, 0.5, jnp.bfloat16) for n in policy}
    state0 = jc.optax.init(tx, params, mesh, AXIS)
    # Laid out as the step's outputs are, so that the step compiles once.
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
    specs = jc.optax.state_specs(state0, AXIS)

    def train(p, s, g):
        u, s = tx.update(jax.tree.map(lambda a: a[0], g), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(
        jax.shard_map(
            train,
            mesh=mesh,
            in_specs=(P(), specs, P(AXIS)),
            out_specs=(P(), specs),
            check_vma=False,
        )
    )

    def go(seq):
        p, s = params, state0
        for g in seq:
            p, s = step(p, s, g)
        return p, s

    seq = gradients(policy, 6, dtype=jnp.bfloat16)
    bad = inject(seq, {2: ("q", 6, 11, np.inf), 4: ("bias", 0, 3, np.nan)})
    p, s = go(bad)
    want_p, want_s = go(drop(seq, (2, 4)))
    assert p["q"].dtype == jnp.bfloat16
    assert_trees_identical(p, want_p, "params")
    assert int(s[1].total_notfinite) == 2 and int(want_s[1].total_notfinite) == 0
    assert int(jc.optax.telemetry(s)["skipped_steps"]) == 2
    assert_trees_identical(without_skip_count(s[0]), want_s[0], "compress state")
    assert_trees_identical(s[1].inner_state, want_s[1].inner_state, "momentum")


def test_onebit_adam_skips_in_and_after_the_warmup(meshes):
    mesh = meshes[AXIS]
    tx = jc.optax.onebit_adam(1e-2, AXIS, warmup_steps=3)
    params = {"w": jnp.zeros(SIZE), "bias": jnp.zeros(BIAS)}
    state0 = jc.optax.init(tx, params, mesh, AXIS)
    seq = gradients(params, 8)
    bad = inject(seq, {1: ("w", 2, 7, np.nan), 5: ("bias", 5, 9, -np.inf)})
    check_skipped(mapped_step(mesh, AXIS, tx, state0), state0, seq, (1, 5), bad)


@pytest.mark.parametrize("rest", [None, "qsgd:bits=4"])
def test_powersgd_skips_for_the_matrices_and_the_rest(meshes, rest):
    """A bad value in a matrix, or in a leaf PowerSGD does not compress
    (exact, or through ``rest``'s codec): the Qs, residuals and the rest's
    state stay as they were."""
    mesh = meshes[AXIS]
    tx = jc.optax.powersgd(AXIS, rank=2, rest=rest)
    params = {"m": jnp.zeros((64, 32)), "v": jnp.zeros(SIZE), "bias": jnp.zeros(BIAS)}
    state0 = jc.optax.init(tx, params, mesh, AXIS)
    rng = np.random.default_rng(3)
    seq = [
        {k: rng.standard_normal((N_DEV, *v.shape)).astype(np.float32) for k, v in params.items()}
        for _ in range(7)
    ]
    bad = [dict(g) for g in seq]
    for t, leaf, idx, value in [(1, "m", (4, 3, 5), np.inf), (3, "v", (1, 9), np.nan)]:
        bad[t][leaf] = bad[t][leaf].copy()
        bad[t][leaf][idx] = value
    check_skipped(mapped_step(mesh, AXIS, tx, state0), state0, seq, (1, 3), bad)


def test_on_nonfinite_is_checked():
    with pytest.raises(ValueError, match="on_nonfinite"):
        jc.optax.compress_gradients("qsgd", AXIS, on_nonfinite="zero")
    with pytest.raises(ValueError, match="on_nonfinite"):
        jc.optax.powersgd(AXIS, on_nonfinite="ignore")
