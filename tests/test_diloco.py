"""jc.optax.diloco (DiLoCo, arXiv 2311.08105): replicas train alone for
sync_every steps, then average their pseudo-gradients and restart from the
same anchor. Four simulated devices, parameters laid out per replica."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

AXIS, N_DEV, LR = "data", 4, 0.05


def mesh_of(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def params0():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (24, 8)) * 0.3,
        "b": jnp.zeros((8,)),
        "k": jax.random.normal(k2, (700,)),
    }


def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2) + 1e-3 * jnp.sum(jnp.sin(p["k"]) ** 2)


def data(t):
    """Each device's batch at step t: [N_DEV, 16, 24] and [N_DEV, 16, 8],
    different per device (the replicas drift apart within a round)."""
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), t))
    x = jax.random.normal(kx, (N_DEV, 16, 24))
    return x, x[..., :8] * 0.5 + 0.1 * jax.random.normal(ky, (N_DEV, 16, 8))


def per_replica(mesh, tree):
    """``tree`` copied once per device along the data axis."""
    sharding = NamedSharding(mesh, P(AXIS))
    return jax.device_put(jax.tree.map(lambda a: jnp.stack([a] * N_DEV), tree), sharding)


def make_step(mesh, tx, state):
    specs = jc.optax.state_specs(state, AXIS)

    def body(params, state, x, y):
        p = jax.tree.map(lambda a: a[0], params)  # this replica's parameters
        g = jax.grad(loss)(p, x[0], y[0])  # its own gradient, not averaged
        u, state = tx.update(g, state, p)
        return jax.tree.map(lambda a: a[None], optax.apply_updates(p, u)), state

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)),
        out_specs=(P(AXIS), specs),
        check_vma=False,
    )
    return jax.jit(f)


def start(mesh, tx):
    params = params0()
    state = jc.optax.init(tx, params, mesh, AXIS)
    return per_replica(mesh, params), state, make_step(mesh, tx, state)


def shards(a) -> list[np.ndarray]:
    return [np.asarray(s.data) for s in a.addressable_shards]


CASES = {
    "float32": {},
    "int8": {"codec": "int8"},
    "qsgd4-ef": {"codec": "qsgd:bits=4", "error_feedback": True},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_replicas_restart_from_one_anchor_every_round(options):
    """After every synchronization the anchor is the same bits on every
    device and every replica's parameters equal it (up to the rounding of
    adding an update to different local values, which never accumulates);
    within a round the replicas differ."""
    mesh = mesh_of(N_DEV)
    tx = jc.optax.diloco(optax.adam(LR), AXIS, sync_every=3, **options)
    params, state, step = start(mesh, tx)
    anchor0 = params0()
    last = {k: np.asarray(v) for k, v in anchor0.items()}  # the anchor of the round
    for t in range(9):
        params, state = step(params, state, *data(t))
        for k in anchor0:
            rows = shards(state.anchor[k])
            for r in rows[1:]:
                np.testing.assert_array_equal(r, rows[0], err_msg=f"{k} step {t + 1}")
            local = np.asarray(params[k])
            if (t + 1) % 3 == 0:
                assert not np.array_equal(rows[0], last[k]), f"{k} step {t + 1}: no outer step"
                scale = np.abs(rows[0]).max() + 1e-30
                assert np.abs(local - rows[0][None]).max() <= 4 * np.finfo(np.float32).eps * scale
                last[k] = rows[0]
            else:  # within a round the anchor stays, and the replicas drift apart
                np.testing.assert_array_equal(rows[0], last[k], err_msg=f"{k} step {t + 1}")
                if k == "w":
                    assert not np.array_equal(local[0], local[1]), f"step {t + 1}"
    assert int(state.step) == 9


# The test's leaves in tree order: b, k, w. Two fragments: {b, w} and {k}.
FRAGMENT = {"b": 0, "k": 1, "w": 0}


def test_streaming_fragments_synchronize_on_their_offsets():
    """fragments=2, sync_every=4: fragment 0 synchronizes at steps 2, 6,
    fragment 1 at 4, 8. At its step a fragment's anchor moves and every
    replica's values equal it; the other fragment's anchor stays (and the
    replicas' w, in fragment 0, stay apart between its synchronizations)."""
    mesh = mesh_of(N_DEV)
    tx = jc.optax.diloco(optax.adam(LR), AXIS, sync_every=4, fragments=2)
    params, state, step = start(mesh, tx)
    assert len(state.outer) == 2
    last = {k: np.asarray(v) for k, v in params0().items()}
    for t in range(1, 9):
        params, state = step(params, state, *data(t))
        due = {0: t % 4 == 2, 1: t % 4 == 0}
        for k, f in FRAGMENT.items():
            rows = shards(state.anchor[k])
            assert all(r.tobytes() == rows[0].tobytes() for r in rows)
            local = np.asarray(params[k])
            if due[f]:
                assert not np.array_equal(rows[0], last[k]), f"{k} step {t}: no outer step"
                scale = np.abs(rows[0]).max() + 1e-30
                assert np.abs(local - rows[0][None]).max() <= 4 * np.finfo(np.float32).eps * scale
                last[k] = rows[0]
            else:
                np.testing.assert_array_equal(rows[0], last[k], err_msg=f"{k} step {t}")
                if k == "w":  # (k's gradient is the same on every replica)
                    assert not np.array_equal(local[0], local[1]), f"{k} step {t}"
    assert int(state.step) == 8


def test_streaming_overlap_merges_tau_steps_later_with_alpha():
    """overlap_steps=1: fragment 0 synchronizes at step 2 (its anchor
    moves; the replicas keep their own values) and is merged at step 3:
    with alpha=0 every replica takes the anchor; with alpha=0.5 the values
    are the mean of alpha=1's (no merge) and alpha=0's, at every leaf of
    the fragment; fragment 1 is not touched."""
    mesh = mesh_of(N_DEV)
    runs = {}
    for alpha in (0.0, 0.5, 1.0):
        tx = jc.optax.diloco(
            optax.adam(LR), AXIS, sync_every=4, fragments=2, overlap_steps=1, alpha=alpha
        )
        params, state, step = start(mesh, tx)
        history = []
        for t in range(1, 4):
            params, state = step(params, state, *data(t))
            history.append((jax.tree.map(np.asarray, params), state))
        runs[alpha] = history
    (p2, s2), (p3, s3) = runs[0.0][1], runs[0.0][2]
    for k, f in FRAGMENT.items():
        anchor = shards(s3.anchor[k])[0]
        np.testing.assert_array_equal(shards(s2.anchor[k])[0], anchor)
        if f == 0:
            assert not np.array_equal(p2[k][0], p2[k][1]), k  # synchronized, not merged
            scale = np.abs(anchor).max() + 1e-30
            assert np.abs(p3[k] - anchor[None]).max() <= 4 * np.finfo(np.float32).eps * scale
            np.testing.assert_allclose(
                runs[0.5][2][0][k],
                0.5 * runs[1.0][2][0][k] + 0.5 * runs[0.0][2][0][k],
                rtol=1e-6,
                atol=1e-7,
            )
        for alpha in (0.5, 1.0):  # identical up to the merge
            np.testing.assert_array_equal(runs[alpha][1][0][k], p2[k])
    np.testing.assert_array_equal(runs[1.0][2][0]["k"], runs[0.0][2][0]["k"])


def test_data_parallel_step_is_the_hand_written_one():
    """jc.data_parallel with diloco (here with Streaming DiLoCo's options)
    lays the parameters out per replica and gives the hand-written
    shard_map step's bits (parameters and state), with each device's own
    loss."""
    mesh = mesh_of(N_DEV)
    tx = jc.optax.diloco(
        optax.adam(LR),
        AXIS,
        sync_every=4,
        codec="qsgd:bits=4",
        error_feedback=True,
        fragments=2,
        overlap_steps=1,
        alpha=0.5,
    )
    hand_params, hand_state, hand_step = start(mesh, tx)
    dp = jc.data_parallel(lambda p, b: loss(p, b[0][0], b[1][0]), tx, mesh)
    params, state = dp.init(params0())
    assert jax.tree.map(lambda a: a.sharding.spec, params) == jax.tree.map(
        lambda a: P(AXIS), params
    )
    for t in range(6):
        x, y = data(t)
        rows = [{k: np.asarray(v)[i] for k, v in hand_params.items()} for i in range(N_DEV)]
        want = [float(loss(rows[i], x[i], y[i])) for i in range(N_DEV)]
        hand_params, hand_state = hand_step(hand_params, hand_state, x, y)
        params, state, losses = dp(params, state, dp.shard_batch((x, y)))
        np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)
    hand = jax.tree.leaves((hand_params, hand_state))
    for a, b in zip(jax.tree.leaves((params, state)), hand, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pmap_step_is_the_shard_map_one():
    """Under jax.pmap (state from jax.pmap(tx.init)) the replicas and the
    anchor follow the shard_map step's (to the last bits: the two programs
    are fused differently)."""
    mesh = mesh_of(N_DEV)
    tx = jc.optax.diloco(optax.adam(LR), AXIS, sync_every=2, codec="int8", fragments=2)
    params, state, step = start(mesh, tx)
    devices = jax.devices()[:N_DEV]
    rows = jax.tree.map(lambda a: jnp.stack([a] * N_DEV), params0())
    pstate = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(rows)

    def body(p, s, x, y):
        u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    pstep = jax.pmap(body, axis_name=AXIS, devices=devices)
    for t in range(5):
        params, state = step(params, state, *data(t))
        rows, pstate = pstep(rows, pstate, *data(t))
    for k in params:
        np.testing.assert_allclose(np.asarray(rows[k]), np.asarray(params[k]), rtol=1e-5)
        np.testing.assert_allclose(
            np.asarray(pstate.anchor[k])[0], shards(state.anchor[k])[0], rtol=1e-5
        )
    assert int(pstate.step[0]) == 5


def test_one_step_rounds_of_sgd_are_data_parallel_sgd():
    """sync_every=1, inner SGD with lr and outer SGD with 1.0: the anchor moves
    by lr times the mean gradient, as data-parallel SGD."""
    mesh = mesh_of(N_DEV)
    tx = jc.optax.diloco(optax.sgd(LR), AXIS, sync_every=1, outer=optax.sgd(1.0))
    params, state, step = start(mesh, tx)
    want = params0()
    for t in range(4):
        x, y = data(t)
        grads = [jax.grad(loss)(want, x[i], y[i]) for i in range(N_DEV)]
        mean = jax.tree.map(lambda *g: sum(g) / N_DEV, *grads)
        want = jax.tree.map(lambda p, g: p - LR * g, want, mean)
        params, state = step(params, state, x, y)
        for k in want:
            np.testing.assert_allclose(
                np.asarray(params[k]), np.stack([want[k]] * N_DEV), rtol=2e-5, atol=1e-6
            )


_CALLED = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation)=(%[\w.\-]+)"
)
_COLLECTIVE = re.compile(
    r"= [^=]*\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\("
)


def _computations(hlo: str) -> tuple[str, dict[str, str]]:
    """(entry name, {name: body}) of an HLO module's text."""
    comps, entry, name, body = {}, None, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?(%[\w.\-]+) .*\{$", line)
        if m:
            name, body = m.group(2), []
            entry = name if m.group(1) else entry
        elif line.startswith("}") and name:
            comps[name] = "\n".join(body)
            name = None
        elif name:
            body.append(line)
    return entry, comps


def _collective_lines(hlo: str, follow_sync: bool) -> list[str]:
    """The collectives reachable from the entry, entering the synchronizing
    branch (branch 1 of a conditional) only if ``follow_sync``."""
    entry, comps = _computations(hlo)
    seen, todo, found = set(), [entry], []
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c].splitlines():
            if _COLLECTIVE.search(line):
                found.append(line)
            todo += _CALLED.findall(line)
            b = re.search(r"branch_computations=\{([^}]*)\}", line)
            if b:
                branches = [s.strip() for s in b.group(1).split(",")]
                todo += branches if follow_sync else branches[:1]
    return found


def _collectives_outside_synchronization(hlo: str) -> tuple[set, set]:
    """The kinds of collective reachable from the entry without entering the
    synchronizing branch, and those reachable with it."""
    return tuple(
        {_COLLECTIVE.search(line).group(1) for line in _collective_lines(hlo, f)}
        for f in (False, True)
    )


_ITEMSIZE = {"u8": 1, "s8": 1, "f32": 4, "u32": 4, "s32": 4, "bf16": 2, "f16": 2}


def _group_axes(line: str, mesh) -> frozenset:
    """The mesh axes that a collective's replica groups span. XLA prints the
    groups as mesh axes (``replica_groups=mesh[...] {'data'}``: the Shardy
    partitioner) or as device ids, listed (``{{0,2},{1,3}}``) or as an iota
    (``[2,2]<=[2,2]T(1,0)``: the GSPMD partitioner, which the suite uses on
    jax 0.11); the ids index the mesh's devices in row-major order."""
    m = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
    if m:
        return frozenset(re.findall(r"'(\w+)'", m.group(1)))
    m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if m:
        groups = [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
    else:
        m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
        shape, dims = [[int(i) for i in g.split(",")] for g in m.groups()[:2]]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(i) for i in m.group(3).split(",")])
        groups = ids.reshape(shape).tolist()
    coords = np.unravel_index(groups[0], tuple(mesh.shape.values()))
    return frozenset(a for a, c in zip(mesh.axis_names, coords, strict=True) if len(set(c)) > 1)


def _operand(line: str, mesh) -> tuple[frozenset, str, int]:
    """(mesh axes of the replica groups, kind, operand bytes per device) of a
    collective of compiled HLO."""
    m = _COLLECTIVE.search(line)
    kind = m.group(1)
    result = line[line.index("=") + 1 : line.index(f" {kind}{m.group(2) or ''}(")]
    nbytes = sum(
        _ITEMSIZE[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
        for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", result)
    )
    if kind == "all-gather":  # the result holds both devices' operands
        nbytes //= 2
    return _group_axes(line, mesh), kind, nbytes


@pytest.mark.parametrize("codec, fragments", [(None, 1), ("int8", 2)])
def test_no_collective_runs_within_a_round(codec, fragments):
    """In the compiled step, every collective is inside the branches that a
    synchronization takes; the other branch (the step within a round), and
    the rest of the step, have none."""
    mesh = mesh_of(N_DEV)
    tx = jc.optax.diloco(
        optax.adam(LR), AXIS, sync_every=4, codec=codec, fragments=fragments, overlap_steps=1
    )
    params, state, step = start(mesh, tx)
    hlo = step.lower(params, state, *data(0)).compile().as_text()
    outside, everywhere = _collectives_outside_synchronization(hlo)
    assert outside == set(), outside
    assert everywhere, "the synchronization has no collective"


def test_two_level_mesh_compresses_only_the_slow_axis():
    """A 2 x 2 mesh, a slow ``replica`` axis times a fast ``data`` axis:
    every step averages the gradients over ``data`` in float32; only the
    synchronization crosses ``replica``, with the int8 payload's bytes
    (``jc.collectives.operand_nbytes``); after it, the anchor is the same
    on all four devices and every replica's parameters equal it."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((2, 2), ("replica", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = jc.optax.diloco(optax.adam(LR), "replica", sync_every=2, codec="int8")
    state = jc.optax.init(tx, params0(), mesh, "replica")
    specs = jc.optax.state_specs(state, "replica")

    def body(params, state, x, y):
        p = jax.tree.map(lambda a: a[0], params)
        g = jax.lax.pmean(jax.grad(loss)(p, x[0], y[0]), "data")
        u, state = tx.update(g, state, p)
        return jax.tree.map(lambda a: a[None], optax.apply_updates(p, u)), state

    both = P(("replica", "data"))
    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("replica"), specs, both, both),
            out_specs=(P("replica"), specs),
            check_vma=False,
        )
    )
    params = jax.device_put(
        jax.tree.map(lambda a: jnp.stack([a] * 2), params0()), NamedSharding(mesh, P("replica"))
    )
    hlo = step.lower(params, state, *data(0)).compile().as_text()
    n = 24 * 8 + 8 + 700
    outside = _collective_lines(hlo, False)
    every_step = [_operand(line, mesh) for line in outside]
    assert every_step and all(g == {"data"} and k == "all-reduce" for g, k, _ in every_step)
    assert sum(b for *_, b in every_step) == 4 * n  # the float32 gradients
    sync = [_operand(line, mesh) for line in _collective_lines(hlo, True) if line not in outside]
    assert sync and all(g == {"replica"} for g, *_ in sync)
    sent: dict[str, int] = {}
    for _, kind, b in sync:
        sent[kind] = sent.get(kind, 0) + b
    assert sent == jc.collectives.operand_nbytes(
        jc.codecs.get("int8"), (n,), jnp.float32, 2, "auto"
    )
    assert sum(sent.values()) < 4 * n / 3

    for t in range(4):
        params, state = step(params, state, *data(t))
        if t % 2 == 1:  # after a synchronization
            for k in state.anchor:
                anchors = shards(state.anchor[k])
                assert all(a.tobytes() == anchors[0].tobytes() for a in anchors)
                for row in shards(params[k]):
                    np.testing.assert_allclose(row[0], anchors[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "streaming",
    [{"sync_every": 3}, {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "alpha": 0.5}],
    ids=["diloco", "streaming"],
)
def test_resume_mid_round_with_orbax_is_bit_identical(tmp_path, streaming):
    """Saving params and state mid-round (two steps into a round of three;
    Streaming: between a fragment's synchronization and its merge),
    restoring them (sharded again) and going on gives the uninterrupted
    run's bits."""
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = mesh_of(N_DEV)
    tx = jc.optax.diloco(
        optax.adam(LR), AXIS, codec="qsgd:bits=4", error_feedback=True, **streaming
    )
    params, state, step = start(mesh, tx)
    whole = (params, state)
    for t in range(7):
        whole = step(*whole, *data(t))
    for t in range(5):
        params, state = step(params, state, *data(t))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckpt.wait_until_finished()
    like = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
    restored = ckpt.restore(tmp_path / "ckpt", like)
    assert restored["state"].residual.sharding.spec == P(AXIS)
    params, state = restored["params"], restored["state"]
    for t in range(5, 7):
        params, state = step(params, state, *data(t))
    for x, y in zip(jax.tree.leaves((params, state)), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


SPARSELOCO = jc.codecs.TopK(
    k_per_bucket=(2, 64), value_codec=jc.codecs.QSGD(bits=2, bucket_size=128)
)


@pytest.mark.parametrize(
    "codec, decay", [("onebit", 1.0), (SPARSELOCO, 0.95)], ids=["onebit", "sparseloco"]
)
def test_error_feedback_carries_what_the_codec_dropped(codec, decay):
    """One round's books with a codec and error feedback: P times the
    anchor's move (outer SGD, lr 1) plus every replica's new residual is the
    sum of the replicas' pseudo-gradients and their old residuals times the
    decay; the residual is not zero (the codec dropped something). With
    SparseLoCo's chunked top-k (2 of every 64), the anchor moves in at most
    2 P places per chunk."""
    mesh = mesh_of(N_DEV)
    tx = jc.optax.diloco(
        optax.sgd(LR),
        AXIS,
        sync_every=1,
        outer=optax.sgd(1.0),
        codec=codec,
        error_feedback=True,
        error_decay=decay,
    )
    params, state, step = start(mesh, tx)

    def flat(tree):
        return np.concatenate([np.ravel(np.asarray(tree[k], np.float64)) for k in sorted(tree)])

    for t in range(3):
        anchor = {k: np.asarray(shards(state.anchor[k])[0]) for k in state.anchor}
        x, y = data(t)
        deltas = sum(flat(jax.grad(loss)(anchor, x[i], y[i])) * LR for i in range(N_DEV))
        old = np.asarray(state.residual, np.float64).sum(0)
        params, state = step(params, state, x, y)
        new_anchor = {k: np.asarray(shards(state.anchor[k])[0]) for k in state.anchor}
        new = np.asarray(state.residual, np.float64).sum(0)
        moved = N_DEV * (flat(anchor) - flat(new_anchor))
        np.testing.assert_allclose(moved + new, deltas + decay * old, rtol=1e-4, atol=1e-5)
        assert np.abs(new).max() > 0
        if codec is SPARSELOCO:
            chunks = np.pad(moved, (0, -len(moved) % 64)).reshape(-1, 64)
            assert (np.count_nonzero(chunks, axis=1) <= 2 * N_DEV).all()
            assert np.count_nonzero(moved) > 0


def test_telemetry_and_misuse():
    mesh = mesh_of(N_DEV)
    tx = jc.optax.diloco(optax.adam(LR), AXIS, sync_every=50, codec="int8")
    params, state, step = start(mesh, tx)
    params, state = step(params, state, *data(0))
    t = jc.optax.telemetry(state)
    n = 24 * 8 + 8 + 700
    every_step = 2 * (N_DEV - 1) / N_DEV * 4 * n  # a float32 ring all-reduce per step
    assert float(t["wire_bytes"]) < every_step / 50
    assert float(t["compression_ratio"]) > 50
    # Streaming: every fragment once a round, each through its own codec call
    tx = jc.optax.diloco(optax.adam(LR), AXIS, sync_every=50, codec="int8", fragments=2)
    params, state, step = start(mesh, tx)
    params, state = step(params, state, *data(0))
    sizes = [24 * 8 + 8, 700]  # {b, w} and {k}
    want = sum(
        jc.collectives.send_nbytes(jc.codecs.get("int8"), m, jnp.float32, N_DEV) for m in sizes
    )
    assert float(jc.optax.telemetry(state)["wire_bytes"]) == pytest.approx(want / 50)
    with pytest.raises(ValueError, match="sync_every"):
        jc.optax.diloco(optax.adam(LR), AXIS, sync_every=0)
    with pytest.raises(ValueError, match="needs a codec"):
        jc.optax.diloco(optax.adam(LR), AXIS, sync_every=2, error_feedback=True)
    for bad, match in [
        ({"fragments": 3}, "must divide sync_every"),
        ({"overlap_steps": 2}, "must be below sync_every"),
        ({"alpha": 2.0}, "alpha must be"),
        ({"fragments": 0}, "fragments must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            jc.optax.diloco(optax.adam(LR), AXIS, sync_every=2, **bad)
    with pytest.raises(ValueError, match="without a floating-point parameter"):
        jc.optax.diloco(optax.adam(LR), AXIS, sync_every=4, fragments=4).init(params0())
    with pytest.raises(ValueError, match="error_decay needs error_feedback"):
        jc.optax.diloco(optax.adam(LR), AXIS, sync_every=2, codec="int8", error_decay=0.9)
    for bad in (1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="error_decay must be"):
            jc.optax.diloco(
                optax.adam(LR),
                AXIS,
                sync_every=2,
                codec="int8",
                error_feedback=True,
                error_decay=bad,
            )
    dp = jc.data_parallel(lambda p, b: loss(p, b[0][0], b[1][0]), tx, mesh)
    replicated, _ = jc.data_parallel(
        lambda p, b: loss(p, b[0][0], b[1][0]), optax.sgd(LR), mesh, require_all_reduce=False
    ).init(params0())
    with pytest.raises(ValueError, match="one copy per replica"):
        dp(replicated, dp.init(params0())[1], data(0))
    wide = jax.make_mesh((2, 2), ("replica", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match="one data axis"):
        jc.data_parallel(loss, tx, wide, ("replica", "data")).init(params0())
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params0(), tx.init(params0()))


def test_the_docs_example_runs():
    """docs/diloco.md's loop, with a model, a mesh and batches of its own."""
    doc = pathlib.Path(__file__).resolve().parents[1] / "docs" / "diloco.md"
    (block,) = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)[:1]
    mesh = mesh_of(N_DEV)
    batches = [jax.device_put(data(t), NamedSharding(mesh, P(AXIS))) for t in range(3)]
    scope = {
        "params": params0(),
        "mesh": mesh,
        "n_devices": N_DEV,
        "batches": batches,
        "loss_fn": lambda p, batch: loss(p, batch[0][0], batch[1][0]),
    }
    exec(block, scope)
    assert int(scope["state"].step) == 3
    assert np.isfinite(np.asarray(scope["local"]["w"])).all()
