"""The compressed reduce-scatter and all-gather (jc.psum_scatter,
jc.all_gather) on simulated devices: Identity equals lax's collectives bit
for bit, the codecs stay within their bounds, what is sent (and kept by
error feedback) accounts for every value, and the bytes on the wire are
those the accounting declares."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp import collectives as jcc

KEY = jax.random.key(7)
TWO = ("slow", "fast")


def _mesh(shape, names):
    n = int(np.prod(shape))
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return Mesh(np.asarray(jax.devices()[:n]).reshape(shape), names)


@pytest.fixture(scope="module")
def mesh8():
    return _mesh((8,), ("d",))


@pytest.fixture(scope="module")
def mesh24():
    return _mesh((2, 4), TWO)


def _spmd(mesh, body, *args):
    """``body(*this device's args, key)`` on every device of ``mesh``: each
    arg is stacked over the devices in mesh order (slow-major), and so is
    every result."""
    axes = mesh.axis_names
    spec = P(axes if len(axes) > 1 else axes[0])

    def f(*a):
        *xs, k = a
        out = body(*(x[0] for x in xs), k)
        return jax.tree.map(lambda o: o[None], out)

    g = jax.jit(
        jax.shard_map(
            f, mesh=mesh, in_specs=(*(spec,) * len(args), P()), out_specs=spec, check_vma=False
        )
    )
    return g, g(*args, KEY)


def _axis(mesh):
    return mesh.axis_names if len(mesh.axis_names) > 1 else mesh.axis_names[0]


def _rows(x, p):
    """Per-device tensors ``[P, ...]`` as float64 ``[P, P, k]``: device d's
    row for owner j."""
    return np.asarray(x, np.float64).reshape(p, p, -1)


def _host_roundtrip(codec, row):
    """A row of one device as its owner decodes it, on the host: padded to
    the codec's split granularity, encoded, decoded, the padding dropped."""
    k = row.size
    g = codec.split_granularity() or k
    kp = -(-k // g) * g
    padded = jnp.pad(jnp.asarray(row, jnp.float32), (0, kp - k))
    return np.asarray(codec.decode(codec.encode(padded)), np.float32)[:k]


# ---------------------------------------------------------------------------
# Identity: lax's collectives, bit for bit
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("tiled", [False, True], ids=["stacked", "tiled"])
def test_identity_is_lax(p, tiled):
    mesh = _mesh((p,), ("d",))
    lead = 3 * p if tiled else p
    x = jax.random.normal(jax.random.key(p), (p, lead, 5))
    codec = jc.codecs.Identity()

    def body(x, k):
        r = jc.psum_scatter(x, "d", codec, tiled=tiled)
        return (
            r.value,
            r.sent,
            jc.all_gather(x, "d", codec, tiled=tiled),
            lax.psum_scatter(x, "d", scatter_dimension=0, tiled=tiled),
            lax.all_gather(x, "d", tiled=tiled),
        )

    _, (v, s, g, v_lax, g_lax) = _spmd(mesh, body, x)
    np.testing.assert_array_equal(v, v_lax)
    np.testing.assert_array_equal(g, g_lax)
    np.testing.assert_array_equal(s, x)
    assert v.shape == v_lax.shape and g.shape == g_lax.shape


@pytest.mark.parametrize("tiled", [False, True], ids=["stacked", "tiled"])
def test_identity_is_lax_on_two_axes(mesh24, tiled):
    lead = 16 if tiled else 8
    x = jax.random.normal(jax.random.key(3), (8, lead, 3))
    codec = jc.codecs.Identity()

    def body(x, k):
        return (
            jc.psum_scatter(x, TWO, codec, tiled=tiled).value,
            jc.all_gather(x, TWO, codec, tiled=tiled),
            lax.psum_scatter(x, TWO, scatter_dimension=0, tiled=tiled),
            lax.all_gather(x, TWO, tiled=tiled),
        )

    _, (v, g, v_lax, g_lax) = _spmd(mesh24, body, x)
    np.testing.assert_array_equal(v, v_lax)
    np.testing.assert_array_equal(g, g_lax)


# ---------------------------------------------------------------------------
# Compressed: against the host, within bounds, conserving
# ---------------------------------------------------------------------------
DETERMINISTIC = [
    jc.codecs.Int8(bucket_size=64),
    jc.codecs.OneBit(bucket_size=64),
    jc.codecs.SignSGD(bucket_size=64),
    jc.codecs.FP8(bucket_size=64),
    jc.codecs.MX(),
    jc.codecs.Cast("bfloat16"),
    jc.codecs.Cast("float16"),
]


@pytest.mark.parametrize("codec", DETERMINISTIC, ids=str)
def test_deterministic_codecs_sum_the_hosts_decodes(mesh8, codec):
    """The value is, bit for bit, the float32 sum in device order of every
    device's row for me as the host encodes and decodes it (rows of 100
    values: padded per row where the codec splits at a granularity)."""
    x = jax.random.normal(jax.random.key(1), (8, 8, 100))
    _, (v, s) = _spmd(mesh8, lambda x, k: tuple(jc.psum_scatter(x, "d", codec))[:2], x)
    xs = np.asarray(x)
    for j in range(8):
        want = _host_roundtrip(codec, xs[0, j])
        for d in range(1, 8):
            want = want + _host_roundtrip(codec, xs[d, j])
        np.testing.assert_array_equal(np.asarray(v[j]), want, err_msg=f"owner {j}")
        np.testing.assert_array_equal(np.asarray(s[3, j]), _host_roundtrip(codec, xs[3, j]))


def _bucket_max(x, bucket):
    """max|x| of each element's bucket, per device and row (rows padded as
    the encode pads them)."""
    a, b, k = x.shape
    kp = -(-k // bucket) * bucket
    b = np.pad(np.abs(x), ((0, 0), (0, 0), (0, kp - k))).reshape(a, b, kp // bucket, bucket)
    return np.repeat(b.max(-1), bucket, axis=-1)[..., :k]


@pytest.mark.parametrize(
    "codec, step",
    [
        # Round to nearest of max/127: half a step, max/254, per device.
        (jc.codecs.Int8(bucket_size=64), 1 / 254),
        # Stochastic rounding between adjacent levels of max/7: one step.
        (jc.codecs.QSGD(bits=4, bucket_size=64), 1 / 7),
    ],
    ids=str,
)
@pytest.mark.parametrize("n", [8 * 128, 8 * 100], ids=["whole-buckets", "padded-rows"])
def test_error_within_the_sum_of_the_senders_bounds(mesh8, codec, step, n):
    x = jax.random.normal(jax.random.key(2), (8, n))
    _, (v, s) = _spmd(
        mesh8, lambda x, k: tuple(jc.psum_scatter(x, "d", codec, key=k, tiled=True))[:2], x
    )
    xs = _rows(x, 8)
    exact = xs.sum(0)  # [owner, k]
    bound = step * _bucket_max(xs, codec.bucket_size).sum(0)
    err = np.abs(np.asarray(v, np.float64).reshape(8, -1) - exact)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-6), float((err - bound).max())
    # Every device's own error obeys its own bound too.
    own = np.abs(_rows(s, 8) - xs)
    assert np.all(own <= step * _bucket_max(xs, codec.bucket_size) * (1 + 1e-5) + 1e-7)


CONSERVING = [
    jc.codecs.QSGD(bits=4, bucket_size=64),
    jc.codecs.TernGrad(bucket_size=64),  # no split granularity: one encode per row
    jc.codecs.Natural(),
    jc.codecs.Int8(bucket_size=64),
]


def _check_sent(v, s, p):
    """Summed over the devices, the rows sent for owner j are j's value."""
    got = _rows(s, p).sum(0)
    want = np.asarray(v, np.float64).reshape(p, -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("codec", CONSERVING, ids=str)
def test_sent_conserves_and_tiled_is_the_same_sum(mesh8, codec):
    x = jax.random.normal(jax.random.key(4), (8, 16, 3, 7))

    def body(x, k):
        r = jc.psum_scatter(x, "d", codec, key=k, tiled=True)
        stacked = jc.psum_scatter(x.reshape(8, 2, 3, 7), "d", codec, key=k)
        return r.value, r.sent, stacked.value

    _, (v, s, v2) = _spmd(mesh8, body, x)
    assert v.shape == (8, 2, 3, 7) and s.shape == x.shape
    _check_sent(v, s, 8)
    np.testing.assert_array_equal(v, v2)


@pytest.mark.parametrize("two_axes", [False, True], ids=["one-axis", "slow-fast"])
def test_pairwise_all_to_all_gives_the_same_bits(mesh8, mesh24, two_axes):
    mesh = mesh24 if two_axes else mesh8
    axis, codec = _axis(mesh), jc.codecs.QSGD(bits=4, bucket_size=64)
    x = jax.random.normal(jax.random.key(16), (8, 8, 70))

    def body(x, k):
        native = jc.psum_scatter(x, axis, codec, key=k, all_to_all="native")
        pairwise = jc.psum_scatter(x, axis, codec, key=k, all_to_all="pairwise")
        return native.value, pairwise.value

    _, (a, b) = _spmd(mesh, body, x)
    np.testing.assert_array_equal(a, b)


def test_half_precision_inputs(mesh8, mesh24):
    codec = jc.codecs.Int8(bucket_size=64)
    x = jax.random.normal(jax.random.key(5), (8, 8, 96)).astype(jnp.bfloat16)
    _, (v2, s2) = _spmd(mesh24, lambda x, k: tuple(jc.psum_scatter(x, TWO, codec))[:2], x)
    assert v2.dtype == jnp.bfloat16 and s2.dtype == jnp.float32
    # The bfloat16 value is the float32 sum of what was sent, rounded.
    total = _rows(s2, 8).sum(0)
    np.testing.assert_allclose(np.asarray(v2, np.float64).reshape(8, -1), total, rtol=2**-8)
    _, (v, s) = _spmd(mesh8, lambda x, k: tuple(jc.psum_scatter(x, "d", codec))[:2], x)
    assert v.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    exact = _rows(x, 8).sum(0)
    # Int8's bound, plus the rounding of the sum to bfloat16.
    bound = _bucket_max(_rows(x, 8), 64).sum(0) / 254 + np.abs(exact) / 128
    assert np.all(np.abs(np.asarray(v, np.float64).reshape(8, -1) - exact) <= bound)
    _check_sent(np.asarray(s, np.float64).reshape(8, 8, -1).sum(0), s, 8)


@pytest.mark.parametrize("codec", [*CONSERVING, jc.codecs.Identity()], ids=str)
@pytest.mark.parametrize("two_axes", [False, True], ids=["one-axis", "slow-fast"])
def test_feedback_conserves(mesh8, mesh24, codec, two_axes):
    """Over the devices, what was to be sent (``x + residual``) is what
    arrived plus what the residuals kept, row by row of every owner; over
    ``(slow, fast)`` axes with the fast hop's exact partial sums."""
    mesh = mesh24 if two_axes else mesh8
    axis = _axis(mesh)
    k = 96
    x = jax.random.normal(jax.random.key(6), (8, 8 * k))
    m = jcc.feedback_size(codec, 8 * k, (2, 4) if two_axes else 8)
    assert m == (2 * k if two_axes else 8 * k)
    r = 0.1 * jax.random.normal(jax.random.key(8), (8, m))

    def body(x, r, key):
        return jcc.psum_scatter_feedback(x, r, axis, codec, key=key, tiled=True)

    _, (v, new_r) = _spmd(mesh, body, x, r)
    assert new_r.shape == (8, m) and new_r.dtype == jnp.float32
    v = np.asarray(v, np.float64)
    if not two_axes:
        before = (_rows(x, 8) + _rows(r, 8)).sum(0)
        after = v + _rows(new_r, 8).sum(0)
    else:
        # Device (s, f) compressed its partial sums [S, k] plus its residual:
        # row t goes to owner (t, f), and the partials of the devices (., f)
        # sum to every device's row for that owner.
        rs = np.asarray(r, np.float64).reshape(2, 4, 2, k).sum(0)  # [f, t, k]
        ns = np.asarray(new_r, np.float64).reshape(2, 4, 2, k).sum(0)
        before = _rows(x, 8).sum(0) + rs.transpose(1, 0, 2).reshape(8, k)
        after = v + ns.transpose(1, 0, 2).reshape(8, k)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())


def test_feedback_over_steps_in_a_scan_loses_nothing(mesh8):
    """Carried through ``lax.scan`` (with shard_map's replication
    checks), over steps: every input is what arrived plus what the
    residuals still hold."""
    codec, steps = jc.codecs.QSGD(bits=2, bucket_size=64), 5
    xs = jax.random.normal(jax.random.key(15), (8, steps, 8 * 64))

    def f(x, key):
        def step(r, i):
            v, r = jcc.psum_scatter_feedback(
                x[0, i], r, "d", codec, key=jax.random.fold_in(key, i), tiled=True
            )
            return r, v

        zero = lax.pcast(jnp.zeros((8 * 64,)), ("d",), to="varying")
        r, vs = lax.scan(step, zero, jnp.arange(steps))
        return vs.sum(0)[None], r[None]

    g = jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=(P("d"), P()), out_specs=P("d")))
    applied, r = g(xs, KEY)
    want = np.asarray(xs, np.float64).sum((0, 1)).reshape(8, 64)
    got = np.asarray(applied, np.float64) + _rows(r, 8).sum(0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.abs(np.asarray(r)).max() > 0  # the coarse codec did keep something


def test_feedback_of_a_zero_residual_is_the_reduce_scatter(mesh8):
    codec = jc.codecs.Int8(bucket_size=64)
    x = jax.random.normal(jax.random.key(9), (8, 8, 100))
    zero = jnp.zeros((8, 800), jnp.float32)

    def body(x, r, k):
        v, kept = jcc.psum_scatter_feedback(x, r, "d", codec)
        plain = jc.psum_scatter(x, "d", codec)
        return v, kept, plain.value, plain.sent

    _, (v, kept, v0, sent) = _spmd(mesh8, body, x, zero)
    np.testing.assert_array_equal(v, v0)
    np.testing.assert_allclose(
        np.asarray(kept).reshape(x.shape), np.asarray(x) - np.asarray(sent), atol=1e-6
    )


@pytest.mark.parametrize(
    "codec", [jc.codecs.Int8(bucket_size=64), jc.codecs.QSGD(bits=4, bucket_size=64)], ids=str
)
def test_two_axes_within_bounds_and_conserving(mesh24, codec):
    x = jax.random.normal(jax.random.key(10), (8, 8, 128))
    _, (v, s) = _spmd(mesh24, lambda x, k: tuple(jc.psum_scatter(x, TWO, codec, key=k))[:2], x)
    _check_sent(v, s, 8)
    xs = _rows(x, 8)
    # The slow hop compresses each fast group's partial sums: two senders per element.
    partial = xs.reshape(2, 4, 8, 128).sum(1)  # [slow, owner, k]
    step = 1 / 254 if codec.name == "int8" else 1 / 7
    bound = step * _bucket_max(partial, 64).sum(0)
    err = np.abs(np.asarray(v, np.float64).reshape(8, -1) - xs.sum(0))
    assert np.all(err <= bound * (1 + 1e-5) + 1e-5)


# ---------------------------------------------------------------------------
# The all-gather
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("two_axes", [False, True], ids=["one-axis", "slow-fast"])
@pytest.mark.parametrize(
    "codec", [jc.codecs.Int8(bucket_size=64), jc.codecs.TernGrad(bucket_size=64)], ids=str
)
def test_all_gather_is_every_devices_decode(mesh8, mesh24, codec, two_axes):
    mesh = mesh24 if two_axes else mesh8
    axis = _axis(mesh)
    x = jax.random.normal(jax.random.key(11), (8, 6, 50))
    _, g = _spmd(mesh, lambda x, k: jc.all_gather(x, axis, codec, key=k), x)
    g = np.asarray(g)
    assert g.shape == (8, 8, 6, 50)
    assert all(np.array_equal(g[0], g[d]) for d in range(8))
    if not codec.stochastic:
        for d in range(8):
            want = np.asarray(codec.decode(codec.encode(x[d])), np.float32)
            np.testing.assert_array_equal(g[0, d], want)
    else:
        # Rounding to 0 or +-max|x| of each bucket: off by at most that max.
        xs = np.asarray(x)
        top = np.abs(xs).reshape(8, -1).max(1)[:, None, None]
        assert np.all(np.abs(g[0] - xs) <= top * (1 + 1e-6))
    _, t = _spmd(mesh, lambda x, k: jc.all_gather(x, axis, codec, key=k, tiled=True), x)
    np.testing.assert_array_equal(np.asarray(t)[0], g[0].reshape(48, 50))


# ---------------------------------------------------------------------------
# Bytes on the wire
# ---------------------------------------------------------------------------
_ITEM = {"f32": 4, "bf16": 2, "f16": 2, "u16": 2, "u8": 1, "s8": 1, "s32": 4, "u32": 4}


def _group(line: str, sizes: dict[str, int]) -> int:
    """Devices in the replica group of a collective's HLO line."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{([^}]*)\}", line)  # as mesh axes: {'fast'}
    names = re.findall(r"'(\w+)'", m.group(1))
    return int(np.prod([sizes[a] for a in names]))


def _hlo_collectives(hlo: str, sizes: dict[str, int]) -> list[tuple[str, int, int]]:
    """(kind, group size, operand bytes) of every collective in the HLO,
    the operand read from the result's shape."""
    out = []
    for line in hlo.splitlines():
        m = re.search(
            r"=\s*(.*?)\s+(all-gather|all-to-all|reduce-scatter|all-reduce|collective-permute)\(",
            line,
        )
        if not m:
            continue
        kind, group = m.group(2), _group(line, sizes)
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        nbytes = sum(
            _ITEM[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            for t, dims in shapes
        )
        if kind == "all-gather":
            nbytes //= group
        elif kind == "reduce-scatter":
            nbytes *= group
        out.append((kind, group, nbytes))
    return sorted(out)


def _declared(alg, codec, n, dtype, axis_sizes):
    """(kind, group size, operand bytes) of every collective ``alg``
    declares. Identity over ``(slow, fast)`` is one collective over both
    axes, declared on the slow one."""
    from jaxcomp._axes import Axes

    axes = Axes.of_sizes(axis_sizes)
    both = axes.hierarchical and codec.rate is jc.codecs.Rate.LINEAR
    return sorted(
        (c.kind, axes.size if both else axes.sizes[c.axis], c.operand)
        for c in alg.collectives(codec, n, dtype, axes)
    )


@pytest.mark.parametrize(
    "codec",
    [
        jc.codecs.QSGD(bits=4, bucket_size=512),
        jc.codecs.Natural(),  # two arrays of different sizes: one collective
        jc.codecs.Cast("bfloat16"),  # 16-bit floats must not be widened
        jc.codecs.TernGrad(bucket_size=64),  # one payload per row
        jc.codecs.Identity(),
    ],
    ids=str,
)
@pytest.mark.parametrize("two_axes", [False, True], ids=["one-axis", "slow-fast"])
def test_bytes_on_the_wire_are_the_accounting(mesh8, mesh24, codec, two_axes):
    mesh = mesh24 if two_axes else mesh8
    axis, sizes = _axis(mesh), dict(mesh.shape)
    axis_sizes = (2, 4) if two_axes else 8
    shape = (8, 1000)
    n = 8000
    x = jax.random.normal(jax.random.key(12), (8, *shape))

    def scatter(x, k):
        return jc.psum_scatter(x, axis, codec, key=k).value

    def gather(x, k):
        return jc.all_gather(x, axis, codec, key=k)

    for fn, alg, nbytes, m in (
        (scatter, jcc.ReduceScatter(), jcc.scatter_nbytes, n),
        (gather, jcc.AllGather(), jcc.gather_nbytes, n),
    ):
        g, _ = _spmd(mesh, fn, x)
        hlo = _hlo_collectives(g.lower(x, KEY).compile().as_text(), sizes)
        assert hlo == _declared(alg, codec, m, jnp.float32, axis_sizes), fn.__name__
        kinds: dict[str, int] = {}
        for kind, _, b in hlo:
            kinds[kind] = kinds.get(kind, 0) + b
        assert kinds == nbytes(codec, shape, jnp.float32, axis_sizes)


def test_qsgd4_sends_at_most_a_sixth_of_float32(mesh8, mesh24):
    codec = jc.codecs.QSGD(bits=4)
    n = 8 * 4096
    x = jax.random.normal(jax.random.key(13), (8, n))
    g, _ = _spmd(mesh8, lambda x, k: jc.psum_scatter(x, "d", codec, key=k, tiled=True).value, x)
    ((kind, _, nbytes),) = _hlo_collectives(g.lower(x, KEY).compile().as_text(), {})
    assert kind == "all-to-all" and nbytes <= 4 * n / 6
    # Over (slow, fast): a float32 reduce-scatter over the fast axis, and
    # compressed bytes only over the slow one, at most a sixth of the slow
    # hop's float32 input (n / fast values).
    g, _ = _spmd(mesh24, lambda x, k: jc.psum_scatter(x, TWO, codec, key=k, tiled=True).value, x)
    got = _hlo_collectives(g.lower(x, KEY).compile().as_text(), {"slow": 2, "fast": 4})
    assert [(kind, group) for kind, group, _ in got] == [("all-to-all", 2), ("reduce-scatter", 4)]
    assert got[0][2] <= 4 * (n // 4) / 6 and got[1][2] == 4 * n


@pytest.mark.parametrize(
    "codec", [jc.codecs.Int8(bucket_size=64), jc.codecs.TernGrad(bucket_size=64)], ids=str
)
def test_kernel_calls_are_the_compiled_programs(mesh8, codec):
    from jaxcomp._axes import Axes
    from jaxcomp._ffi import Backend, resolve_backend

    if resolve_backend("auto") is Backend.XLA or not jc.cpu_available():
        pytest.skip("counts the kernels' custom calls: needs the CPU kernels")

    x = jax.random.normal(jax.random.key(14), (8, 8 * 100))
    for fn, alg in (
        (lambda x, k: tuple(jc.psum_scatter(x, "d", codec, key=k, tiled=True))[:2], "scatter"),
        (lambda x, k: jc.all_gather(x, "d", codec, key=k), "gather"),
    ):
        g, _ = _spmd(mesh8, fn, x)
        calls = re.findall(r'custom_call_target="jaxcomp_', g.lower(x, KEY).compile().as_text())
        algorithm = jcc.ReduceScatter() if alg == "scatter" else jcc.AllGather()
        assert len(calls) == len(algorithm.kernel_calls(codec, 800, jnp.float32, Axes((8,))))


def test_send_nbytes():
    from jaxcomp._axes import Axes

    codec, n = jc.codecs.QSGD(bits=4), 8 * 4096
    rs, ag = jcc.ReduceScatter(), jcc.AllGather()
    one, two = Axes((8,)), Axes((2, 4))
    a2a = jcc.scatter_nbytes(codec, (n,), jnp.float32, 8)["all-to-all"]
    assert rs.send_nbytes(codec, n, jnp.float32, one) == 7 / 8 * a2a
    # Identity: what lax.psum_scatter sends, over one axis or both.
    ident = jc.codecs.Identity()
    for axes in (one, two):
        assert rs.send_nbytes(ident, n, jnp.float32, axes) == 7 / 8 * 4 * n
        assert ag.send_nbytes(ident, n, jnp.float32, axes) == 7 * 4 * n
    slow = jcc.scatter_nbytes(codec, (n,), jnp.float32, (2, 4))["all-to-all"]
    assert rs.send_nbytes(codec, n, jnp.float32, two) == 3 / 4 * 4 * n + 1 / 2 * slow
    w = codec.wire_nbytes((n,))
    assert ag.send_nbytes(codec, n, jnp.float32, two) == w + 3 * 2 * w


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------
def _trace(mesh, body, x):
    spec = P(mesh.axis_names[0])
    f = jax.shard_map(lambda x: body(x[0])[None], mesh=mesh, in_specs=spec, out_specs=spec)
    jax.eval_shape(f, x)


def test_errors_say_what_to_do(mesh8):
    x = jnp.zeros((8, 8, 4))
    int8, qsgd = jc.codecs.Int8(), jc.codecs.QSGD(bits=4)
    cases = [
        (lambda x: jc.psum_scatter(x[:4], "d", int8).value, "must equal the 8 devices"),
        (lambda x: jc.psum_scatter(x[:4], "d", int8, tiled=True).value, "multiple of the 8"),
        (lambda x: jc.psum_scatter(x, "d", qsgd).value, "needs key="),
        (lambda x: jc.all_gather(x, "d", qsgd)[0], "needs key="),
        (lambda x: jc.psum_scatter(x, "d", jc.codecs.TopK()).value, "fixed-size codecs"),
        (lambda x: jc.all_gather(x, "d", jc.codecs.ThreeLC())[0], "fixed-size codecs"),
        (lambda x: jc.psum_scatter(x, "nope", int8).value, "'nope' is not bound"),
        (lambda x: jc.all_gather(x, ("d",), int8)[0], "(slow, fast)"),
        (lambda x: jc.psum_scatter(x, "d", int8, state=jnp.zeros(3)).value, "state must be None"),
        (lambda x: jc.psum_scatter(x, "d", int8, all_to_all="x").value, "all_to_all must be"),
        (
            lambda x: jcc.psum_scatter_feedback(x, jnp.zeros(3), "d", int8)[0],
            r"residual must be float32\[32\]",
        ),
    ]
    for body, match in cases:
        with pytest.raises(ValueError, match=re.escape(match) if "\\" not in match else match):
            _trace(mesh8, body, x)
    with pytest.raises(ValueError, match="not a multiple"):
        jcc.feedback_size(int8, 10, 4)
    with pytest.raises(ValueError, match="do not split over 4 devices"):
        jcc.scatter_nbytes(int8, (10,), jnp.float32, 4)
    with pytest.raises(ValueError, match="fixed-size codecs"):
        jcc.gather_nbytes("threelc", (10,), jnp.float32, 4)


def test_not_in_the_all_reduce_registry():
    assert "reduce_scatter" not in jcc.ALGORITHMS and "all_gather" not in jcc.ALGORITHMS
