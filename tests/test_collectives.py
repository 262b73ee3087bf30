"""Compressed psum/pmean on 8 simulated devices: identical results,
exact error-feedback accounting, bytes on the wire read from the HLO."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import config as jax_config
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
import jaxcomp._ffi
from jaxcomp import collectives as jcc

N_DEV = 8
ALGS = ["allgather", "two_phase", "ring"]
# One codec per code path of the algorithms: linear, 16-bit payloads, a
# deterministic and a stochastic bucketed codec (payloads cut per owner), and
# whole-tensor payloads (one batched encode of the chunks).
CODECS = [
    jc.codecs.Identity(),
    jc.codecs.Cast("bfloat16"),
    jc.codecs.Int8(bucket_size=64),
    jc.codecs.QSGD(bits=4, bucket_size=64),
    jc.codecs.OneBit(bucket_size=64),
    jc.codecs.TernGrad(bucket_size=64),
]
# Loose sanity bounds on ||value - exact|| / ||exact|| for Gaussian inputs.
REL_ERR = {
    "identity": 1e-6,
    "cast": 2e-2,
    "int8": 5e-2,
    "qsgd": 0.6,
    "onebit": 1.2,
    "terngrad": 2.5,
}


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N_DEV:
        pytest.skip(f"needs {N_DEV} devices")
    return jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


KEY = jax.random.key(5)


def _run(mesh, codec, alg, x, key=KEY, fn=jcc.psum):
    def f(x, k):
        r = fn(x[0], "data", codec, key=k, algorithm=alg)
        return r.value[None], r.sent[None]

    g = jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P("data")))
    )
    return g, g(x, key)


@pytest.mark.parametrize(
    "codec, alg, n",
    [
        (codec, alg, [1001, 64][(i + j) % 2])  # 64: fewer values than some buckets
        for i, codec in enumerate(CODECS)
        for j, alg in enumerate([*ALGS, "auto"])
    ],
    ids=repr,
)
def test_psum_identical_conserving_and_close(mesh, codec, alg, n):
    x = jax.random.normal(jax.random.key(n), (N_DEV, n))
    _, (v, s) = _run(mesh, codec, alg, x)
    v, s = np.asarray(v, np.float64), np.asarray(s, np.float64)
    assert np.all(v == v[0]), "value differs between devices"
    # Error feedback: what the devices sent adds up to what everyone got.
    np.testing.assert_allclose(s.sum(0), v[0], rtol=1e-5, atol=1e-5)
    exact = np.asarray(x, np.float64).sum(0)
    assert np.linalg.norm(v[0] - exact) <= REL_ERR[codec.name] * np.linalg.norm(exact)


@pytest.mark.parametrize("alg", [*ALGS, "sparse"])
def test_fused_decodes_match_the_kernels(mesh, alg, monkeypatch):
    """On GPUs the collectives decode element-wise codecs through their
    twins, which XLA fuses into the sum or the residual (``fused_backend``:
    "fused"; on the CPU it is the kernel): the twins fused give the
    kernels' results up to float32 rounding (XLA may contract a decoded
    product and the add it feeds into one FMA)."""
    if alg == "sparse":  # the dense stage's Int8 is decoded by its twin
        codecs = [jc.codecs.TopK(fraction=0.05, value_codec=jc.codecs.Int8(bucket_size=64))]
    else:
        codecs = [c for c in CODECS if c.elementwise_decode]
    x = jax.random.normal(jax.random.key(3), (N_DEV, 1000))

    def run():
        """Every codec's all-reduce in one program (one compile)."""

        def f(x, k):
            out = []
            for c in codecs:
                m = jcc.state_size(c, 1000, jnp.float32, N_DEV, alg)
                r = jcc.pmean(x[0], "data", c, key=k, algorithm=alg, state=jnp.full((m,), 0.25))
                out.append((r.value[None], r.sent[None], r.state[None]))
            return out

        spec = P("data")
        g = jax.shard_map(f, mesh=mesh, in_specs=(spec, P()), out_specs=spec)
        return [[np.asarray(a) for a in r] for r in jax.jit(g)(x, KEY)]

    from jaxcomp.collectives import _decode

    monkeypatch.setattr(_decode, "fused_backend", lambda codec: "xla")
    fused = run()
    monkeypatch.setattr(_decode, "fused_backend", lambda codec: "auto")
    kernels = run()
    monkeypatch.undo()
    for c, f_out, k_out in zip(codecs, fused, kernels, strict=True):
        for a, b in zip(f_out, k_out, strict=True):
            np.testing.assert_allclose(
                a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max(initial=1.0), err_msg=repr(c)
            )


def test_cpu_collectives_decode_with_the_kernels(mesh):
    """On the CPU the collectives' "fused" decode lowers to the kernel (the
    twin's fused loops are slower there); forcing the twin leaves no decode
    custom call in the program."""
    codec = jc.codecs.TernGrad(bucket_size=64)  # element-wise
    assert codec.elementwise_decode
    x = jax.random.normal(jax.random.key(0), (N_DEV, 4096))

    def hlo(alg):
        g, _ = _run(mesh, codec, alg, x)
        return g.lower(x, KEY).compile().as_text()

    from jaxcomp.collectives import _decode

    with pytest.MonkeyPatch.context() as m:
        # as a codec without a decode-and-sum kernel: the rows decoded, then summed
        m.setattr(type(codec), "decode_sum_kernel", False)
        for alg in ALGS:
            assert '"jaxcomp_terngrad_decode"' in hlo(alg), alg
        m.setattr(_decode, "fused_backend", lambda codec: "xla")
        assert "jaxcomp_terngrad_decode" not in hlo("two_phase")


def test_elementwise_decodes_have_no_loops_or_scatters():
    """``Codec.elementwise_decode`` is a promise XLA's fusion relies on: the
    twin decode of every codec that makes it is free of loops, scans,
    scatters and sorts."""
    for cls in jc.codecs.registered():
        for codec in cls.examples(coverage=True):
            if not codec.elementwise_decode:
                continue
            layout = codec.layout((999,), jnp.float32)
            arrays = [jnp.zeros(a.shape, a.dtype) for a in layout.values()]

            def decode(*a, c=codec):
                return c.decode(c.payload(a, (999,), jnp.float32), backend="xla")

            jaxpr = str(jax.make_jaxpr(decode)(*arrays))
            for bad in ("while", "scan", "scatter", "sort", "cumsum"):
                assert bad not in jaxpr, (codec, bad)


def test_identity_equals_lax_psum(mesh):
    x = jax.random.normal(jax.random.key(0), (N_DEV, 777))
    ref = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
        )
    )(x)
    for alg in ALGS:
        _, (v, _) = _run(mesh, jc.codecs.Identity(), alg, x)
        np.testing.assert_allclose(np.asarray(v[0]), np.asarray(ref[0]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("alg", ALGS)
def test_int8_allgather_within_half_a_step_per_device(mesh, alg):
    """Deterministic bound: each compression stage errs by at most half of
    its bucket's step; allgather has one stage per device."""
    codec = jc.codecs.Int8(bucket_size=64)
    x = jax.random.normal(jax.random.key(9), (N_DEV, 640))
    _, (v, s) = _run(mesh, codec, alg, x)
    xs = np.asarray(x, np.float64)
    err = np.abs(np.asarray(s, np.float64) - xs)
    if alg == "allgather":
        half = np.repeat(np.abs(xs).reshape(N_DEV, -1, 64).max(-1) / 127 / 2, 64, axis=1)
        assert np.all(err <= half * (1 + 1e-5) + 1e-7)
    # Whatever the algorithm: the sum of everyone's error is the total error.
    np.testing.assert_allclose(
        (np.asarray(s, np.float64) - xs).sum(0), np.asarray(v[0], np.float64) - xs.sum(0), atol=1e-5
    )


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("codec", [CODECS[3], CODECS[4]], ids=repr)
def test_pmean_value_is_the_mean_and_sent_conserves(mesh, codec, alg):
    """pmean divides before the last compression; sent stays in units of the
    sum, so what the devices sent adds up to P times the mean."""
    x = jax.random.normal(jax.random.key(7), (N_DEV, 1001))
    _, (v, s) = _run(mesh, codec, alg, x, fn=jcc.pmean)
    v, s = np.asarray(v, np.float64), np.asarray(s, np.float64)
    assert np.all(v == v[0])
    np.testing.assert_allclose(s.sum(0), N_DEV * v[0], rtol=1e-5, atol=1e-5)
    exact = np.asarray(x, np.float64).mean(0)
    assert np.linalg.norm(v[0] - exact) <= REL_ERR[codec.name] * np.linalg.norm(exact)


def test_pmean_is_psum_over_size(mesh):
    codec = jc.codecs.Int8(bucket_size=64)
    x = jax.random.normal(jax.random.key(2), (N_DEV, 300))
    _, (vs, _) = _run(mesh, codec, "two_phase", x)
    _, (vm, _) = _run(mesh, codec, "two_phase", x, fn=jcc.pmean)
    np.testing.assert_allclose(np.asarray(vm[0]), np.asarray(vs[0]) / N_DEV, rtol=1e-6)


def test_stochastic_codecs_use_a_key_per_device(mesh):
    codec = jc.codecs.QSGD(bits=2, bucket_size=64)
    x = jnp.tile(
        jax.random.normal(jax.random.key(4), (1, 512)), (N_DEV, 1)
    )  # same input everywhere
    _, (_, s) = _run(mesh, codec, "allgather", x)
    s = np.asarray(s)
    assert not all(np.array_equal(s[0], s[d]) for d in range(1, N_DEV))


def _collective_bytes(hlo: str, group: int) -> dict[str, int]:
    """Operand bytes per collective kind, from the result shapes in the HLO."""
    sizes = {"f32": 4, "bf16": 2, "f16": 2, "u16": 2, "u8": 1, "s8": 1, "s32": 4, "u32": 4}
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s+(all-gather|all-to-all|collective-permute|all-reduce)\(", line)
        if not m:
            continue
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        nbytes = sum(
            sizes[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            for t, dims in shapes
        )
        if m.group(2) == "all-gather":
            nbytes //= group  # the result holds every device's operand
        out[m.group(2)] = out.get(m.group(2), 0) + nbytes
    return out


@pytest.mark.parametrize(
    "codec, alg",
    [
        (codec, alg)
        for codec in (
            jc.codecs.QSGD(bits=4, bucket_size=512),
            jc.codecs.Natural(),  # two arrays of different sizes
            jc.codecs.Cast("bfloat16"),  # 16-bit floats must not be widened by the backend
        )
        for alg in ALGS
    ]
    + [(jc.codecs.Identity(), "auto")],  # linear: one all-reduce of the payload
    ids=repr,
)
def test_bytes_on_the_wire_match_the_accounting(mesh, codec, alg):
    n = 1 << 16
    x = jax.random.normal(jax.random.key(0), (N_DEV, n))
    g, _ = _run(mesh, codec, alg, x)
    hlo = g.lower(x, jax.random.key(5)).compile().as_text()
    measured = _collective_bytes(hlo, N_DEV)
    assert measured == jcc.operand_nbytes(codec, (n,), jnp.float32, N_DEV, alg)
    # Against lax.psum's ring all-reduce, 2 (P-1)/P of the float32 tensor per device:
    psum_wire = 2 * (N_DEV - 1) / N_DEV * 4 * n
    wire = jcc.send_nbytes(codec, n, jnp.float32, N_DEV, alg)
    ratio = 32 / codec.bits_per_element((n,))
    # The algorithm's own factor: allgather receives P - 1 payloads.
    expected = {"allgather": N_DEV / 2, "two_phase": 1.0, "ring": 1.0, "auto": 1.0}[alg]
    assert wire == pytest.approx(psum_wire / ratio * expected, rel=0.02)


@pytest.mark.parametrize("alg", [*ALGS, "sparse"])
def test_twins_give_the_kernels_results(mesh, monkeypatch, alg):
    """The whole all-reduce on the pure-JAX twins (JAXCOMP_BACKEND=xla, the
    path of platforms without kernels) gives the kernels' bytes, variable-rate
    tiers included; the sparse algorithm sums duplicate indices in an
    unspecified order, so there the last bits may differ."""
    if not jc.cpu_available():
        pytest.skip("CPU kernels not built")
    codecs = {
        "allgather": jc.codecs.ThreeLC(sparsity=1.5),
        "two_phase": jc.codecs.QSGD(bits=4, bucket_size=64),
        "ring": jc.codecs.TernGrad(bucket_size=64),
        "sparse": jc.codecs.TopK(fraction=0.3, value_codec=jc.codecs.Int8(bucket_size=64)),
    }
    codec = codecs[alg]
    x = _sparse_input(3001, density=0.5, seed=4)
    monkeypatch.setattr(jaxcomp._ffi, "_DEFAULT", "ffi")  # JAXCOMP_BACKEND's value
    _, want = _run(mesh, codec, alg, x)
    monkeypatch.setattr(jaxcomp._ffi, "_DEFAULT", "xla")
    g, got = _run(mesh, codec, alg, x)
    assert "jaxcomp_" not in g.lower(x, KEY).as_text()
    for a, b in zip(want, got, strict=True):
        if alg == "sparse":
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(
                np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)
            )


def test_errors_are_clear(mesh):
    codec = jc.codecs.QSGD(bits=4)
    with pytest.raises(ValueError, match="not bound"):
        jcc.psum(jnp.ones(8), "data", codec, key=jax.random.key(0))
    with pytest.raises(ValueError, match="algorithm"):
        _run(mesh, codec, "tree", jnp.ones((N_DEV, 8)))
    with pytest.raises(ValueError, match="needs key"):
        _run(mesh, codec, "allgather", jnp.ones((N_DEV, 8)), key=None)


def test_pmap(mesh):
    codec = jc.codecs.Int8(bucket_size=64)
    x = jax.random.normal(jax.random.key(3), (N_DEV, 200))
    f = jax.pmap(lambda x: jcc.psum(x, "i", codec, algorithm="two_phase"), axis_name="i")
    r = f(x)
    _, (v, _) = _run(mesh, codec, "two_phase", x)
    np.testing.assert_array_equal(np.asarray(r.value), np.asarray(v))


@pytest.fixture(scope="module")
def mesh2d():
    if len(jax.devices()) < N_DEV:
        pytest.skip(f"needs {N_DEV} devices")
    return jax.make_mesh((2, 4), ("node", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _run2d(mesh2d, codec, x, algorithm="hierarchical"):
    def f(x, k):
        r = jcc.psum(x[0, 0], ("node", "local"), codec, key=k, algorithm=algorithm)
        return r.value[None, None], r.sent[None, None]

    spec = P("node", "local")
    g = jax.jit(jax.shard_map(f, mesh=mesh2d, in_specs=(spec, P()), out_specs=(spec, spec)))
    return g, g(x, KEY)


@pytest.mark.parametrize(
    "codec",
    [jc.codecs.Identity(), jc.codecs.Int8(bucket_size=64), jc.codecs.QSGD(bits=4, bucket_size=64)],
    ids=repr,
)
def test_hierarchical_sum_and_conservation(mesh2d, codec):
    x = jax.random.normal(jax.random.key(1), (2, 4, 999))
    _, (v, s) = _run2d(mesh2d, codec, x)
    v = np.asarray(v, np.float64).reshape(N_DEV, -1)
    s = np.asarray(s, np.float64).reshape(N_DEV, -1)
    assert np.all(v == v[0])
    np.testing.assert_allclose(s.sum(0), v[0], rtol=1e-5, atol=1e-5)
    exact = np.asarray(x, np.float64).reshape(N_DEV, -1).sum(0)
    assert np.linalg.norm(v[0] - exact) <= REL_ERR[codec.name] * np.linalg.norm(exact)


def test_hierarchical_compresses_only_over_the_slow_axis(mesh2d):
    codec = jc.codecs.QSGD(bits=4, bucket_size=512)
    n = 1 << 14
    x = jax.random.normal(jax.random.key(1), (2, 4, n))
    g, _ = _run2d(mesh2d, codec, x)
    hlo = g.lower(x, KEY).compile().as_text()
    saw_fast_f32 = saw_slow_u8 = False
    for line in hlo.splitlines():
        m = re.search(
            r"=\s*(.*?)\s+(all-gather|all-to-all|reduce-scatter|all-reduce|collective-permute)\(",
            line,
        )
        if not m:
            continue
        # Replica groups print as mesh axes ({'local'}) or as device lists.
        over_fast = "{'local'}" in line or "{0,1,2,3}" in line
        over_slow = "{'node'}" in line or "{0,4}" in line
        assert over_fast != over_slow, line[:300]
        if "u8[" in m.group(1):
            assert over_slow, f"compressed data over the fast axis: {line[:200]}"
            saw_slow_u8 = True
        elif "f32[" in m.group(1) and over_fast:
            saw_fast_f32 = True
    assert saw_slow_u8 and saw_fast_f32


def test_hierarchical_needs_two_axes(mesh):
    with pytest.raises(ValueError, match="hierarchical"):
        _run(mesh, jc.codecs.Int8(), "hierarchical", jnp.ones((N_DEV, 8)))


# ---------------------------------------------------------------------------
# Sparse (TopK) and variable-rate (ThreeLC) payloads
# ---------------------------------------------------------------------------
def _sparse_input(n, density=0.1, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    mask = jax.random.uniform(k1, (N_DEV, n)) < density
    return jax.random.laplace(k2, (N_DEV, n)) * mask


def _decoded_sum(codec, x):
    """Sum over devices of each device's own decode(encode(x_d)) (deterministic codecs)."""
    rows = [np.asarray(codec.decode(codec.encode(x[d])), np.float64) for d in range(x.shape[0])]
    return np.sum(rows, axis=0)


TOPKS = [
    jc.codecs.TopK(fraction=0.01),  # static sparse all-reduce
    jc.codecs.TopK(fraction=0.3),  # DSAR_Split_allgather (too dense for the static one)
    jc.codecs.TopK(k_per_bucket=(8, 512)),
]


@pytest.mark.parametrize("alg", ["sparse", "allgather", "auto"])
@pytest.mark.parametrize("codec", TOPKS, ids=repr)
def test_sparse_algorithms_sum_the_kept_pairs(mesh, codec, alg):
    x = _sparse_input(5000)
    _, (v, s) = _run(mesh, codec, alg, x)
    v, s = np.asarray(v, np.float64), np.asarray(s, np.float64)
    assert np.all(v == v[0])
    np.testing.assert_allclose(v[0], _decoded_sum(codec, x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s.sum(0), v[0], rtol=1e-5, atol=1e-5)


def test_sparse_rule_follows_density(mesh):
    n = 5000
    assert jcc.choose_algorithm(TOPKS[0], n, N_DEV) == "sparse"
    assert jc.collectives._sparse.static_fits(TOPKS[0], n, jnp.float32, N_DEV)
    assert not jc.collectives._sparse.static_fits(TOPKS[1], n, jnp.float32, N_DEV)


@pytest.mark.parametrize("fn", [jcc.psum, jcc.pmean], ids=["psum", "pmean"])
def test_sparse_split_with_quantized_dense_stage_conserves(mesh, fn):
    """SparCML section 6: the owned ranges travel QSGD-quantized; the owner
    carries that error, so sent still adds up to the result."""
    codec = jc.codecs.TopK(fraction=0.3, value_codec=jc.codecs.QSGD(bits=4, bucket_size=64))
    x = _sparse_input(4096, density=0.5, seed=3)
    _, (v, s) = _run(mesh, codec, "sparse", x, fn=fn)
    v, s = np.asarray(v, np.float64), np.asarray(s, np.float64)
    assert np.all(v == v[0])
    scale = N_DEV if fn is jcc.pmean else 1
    np.testing.assert_allclose(s.sum(0), scale * v[0], rtol=1e-5, atol=1e-5)


def test_sparse_needs_a_sparse_codec(mesh):
    with pytest.raises(ValueError, match="index/value pairs"):
        _run(mesh, jc.codecs.QSGD(bits=4), "sparse", jnp.ones((N_DEV, 64)))


def test_sparse_static_bytes_match_the_accounting(mesh):
    codec, n = TOPKS[0], 1 << 14
    x = jax.random.normal(jax.random.key(0), (N_DEV, n))
    g, _ = _run(mesh, codec, "sparse", x)
    measured = _collective_bytes(g.lower(x, KEY).compile().as_text(), N_DEV)
    assert measured == jcc.operand_nbytes(codec, (n,), jnp.float32, N_DEV, "sparse")
    assert measured["all-gather"] * (N_DEV - 1) < 2 * (N_DEV - 1) / N_DEV * 4 * n / 10


THREELCS = [jc.codecs.ThreeLC(sparsity=1.0), jc.codecs.ThreeLC(sparsity=1.75)]


@pytest.mark.parametrize(
    "codec, alg", [(THREELCS[i % 2], alg) for i, alg in enumerate(ALGS)], ids=repr
)
def test_variable_rate_identical_and_conserving(mesh, codec, alg):
    x = _sparse_input(3001, density=0.2, seed=1)
    _, (v, s) = _run(mesh, codec, alg, x)
    v, s = np.asarray(v, np.float64), np.asarray(s, np.float64)
    assert np.all(v == v[0])
    np.testing.assert_allclose(s.sum(0), v[0], rtol=1e-5, atol=1e-5)
    if alg == "allgather":  # one compression: exactly the sum of the decodes
        np.testing.assert_allclose(v[0], _decoded_sum(codec, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("density", [0.0, 0.01, 1.0])
def test_capacity_tiers_never_truncate(mesh, density):
    """Whatever tier the data lands in (all zeros, sparse, dense), the result
    is the sum of the full-capacity decodes."""
    codec = jc.codecs.ThreeLC(sparsity=1.0)
    x = _sparse_input(10000, density=density, seed=2)
    _, (v, _) = _run(mesh, codec, "allgather", x)
    np.testing.assert_allclose(np.asarray(v[0]), _decoded_sum(codec, x), rtol=1e-6, atol=1e-6)


def test_capacity_tiers_in_the_hlo(mesh):
    """The compiled program holds one all-gather per tier, each moving one
    byte buffer: that tier's capacity of stream, then the payload's other
    arrays (scale, length, flag): the bytes on the wire follow the data."""
    codec, n = jc.codecs.ThreeLC(sparsity=1.0), 1 << 14
    caps = jcc.tier_capacities(codec, n)
    assert caps[-1] == codec.stream_capacity(n) and caps[0] == -(-caps[-1] // 14)
    layout = codec.arrays(n, jnp.float32)
    rest = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in layout.values()) - caps[-1]
    assert 0 < rest < 16
    x = jax.random.normal(jax.random.key(0), (N_DEV, n))
    g, _ = _run(mesh, codec, "allgather", x)
    hlo = g.lower(x, KEY).compile().as_text()
    u8 = {int(d) for d in re.findall(r"u8\[8,(\d+)\][^=]*all-gather\(", hlo)}
    assert u8 == {c + rest for c in caps}


@pytest.mark.parametrize("data", ["zeros", "signs"])
def test_wire_log_shows_the_tier_taken(mesh, data):
    """All zeros: the smallest tier (the stream shrinks 14-fold); random
    signs of one magnitude: no zero trit at all, the full size."""
    codec, n = jc.codecs.ThreeLC(sparsity=1.0), 1 << 14
    caps = jcc.tier_capacities(codec, n)
    if data == "zeros":
        x = jnp.zeros((N_DEV, n))
    else:
        x = jnp.sign(jax.random.normal(jax.random.key(4), (N_DEV, n)))
    with jcc.wire_log() as log:
        _, out = _run(mesh, codec, "allgather", x)
        jax.block_until_ready(out)
    assert len(log) == N_DEV and {k for k, _ in log} == {"all-gather"}
    cap = caps[0] if data == "zeros" else caps[-1]
    want = jc.codecs.ThreeLC(sparsity=1.0, capacity=cap).wire_nbytes((n,))
    assert {b for _, b in log} == {want}


def test_wire_log_of_fixed_rate_equals_the_accounting(mesh):
    codec, n = jc.codecs.QSGD(bits=4, bucket_size=512), 1 << 14
    x = jax.random.normal(jax.random.key(0), (N_DEV, n))
    with jcc.wire_log() as log:
        jax.block_until_ready(_run(mesh, codec, "two_phase", x)[1])
    per_device: dict[str, int] = {}
    for kind, b in log:
        per_device[kind] = per_device.get(kind, 0) + b
    per_device = {k: v // N_DEV for k, v in per_device.items()}
    assert per_device == jcc.operand_nbytes(codec, (n,), jnp.float32, N_DEV, "two_phase")


# ---------------------------------------------------------------------------
# Two-level error feedback: the server residual (state=)
# ---------------------------------------------------------------------------
def _run_state(mesh, codec, alg, x, state, fn=jcc.psum):
    axis = "data" if mesh.axis_names == ("data",) else tuple(mesh.axis_names)
    spec = P(axis)

    def f(x, st, k):
        r = fn(x[0], axis, codec, key=k, algorithm=alg, state=st[0])
        return r.value[None], r.sent[None], r.state[None]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(spec,) * 3))
    return g(x, state, KEY)


@pytest.fixture(scope="module")
def mesh42():
    """Four nodes of two: the slow axis is large enough for two-phase."""
    if len(jax.devices()) < N_DEV:
        pytest.skip(f"needs {N_DEV} devices")
    return jax.make_mesh((4, 2), ("node", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


STATE_CASES = [
    (jc.codecs.OneBit(bucket_size=64), "two_phase", 1001),
    (jc.codecs.TernGrad(bucket_size=64), "two_phase", 64),
    (jc.codecs.QSGD(bits=4, bucket_size=64), "ring", 1001),
    (jc.codecs.Cast("bfloat16"), "ring", 64),
    (jc.codecs.ThreeLC(), "two_phase", 1001),
    (jc.codecs.TopK(fraction=0.3, value_codec=jc.codecs.QSGD(bits=4)), "sparse", 1001),
    (jc.codecs.TopK(fraction=0.3), "sparse", 1001),
    (jc.codecs.TopK(fraction=0.01), "sparse", 1001),  # static: no state
    (jc.codecs.Int8(bucket_size=64), "allgather", 1001),  # no state
    (jc.codecs.QSGD(bits=4, bucket_size=64), "hierarchical", 999),
]


@pytest.mark.parametrize("fn", [jcc.psum, jcc.pmean], ids=["psum", "pmean"])
@pytest.mark.parametrize("codec, alg, n", STATE_CASES, ids=repr)
def test_server_state_conserves(mesh, mesh42, codec, alg, n, fn):
    """With a server residual, what the devices sent plus what the states
    released (div x (old - new), at their positions) adds up to div x the
    value; the value is identical on every device and sent is the device's
    own first compression."""
    m = mesh42 if alg == "hierarchical" else mesh
    sizes = (4, 2) if alg == "hierarchical" else N_DEV
    size = jcc.state_size(codec, n, jnp.float32, sizes, alg)
    # A state exactly where the algorithm compresses a second time (the
    # static sparse all-reduce and allgather compress once).
    assert (size > 0) == (alg not in ("allgather",) and codec != jc.codecs.TopK(fraction=0.01))
    x = jax.random.normal(jax.random.key(n), (N_DEV, n))
    st = 0.3 * jax.random.normal(jax.random.key(1), (N_DEV, size))
    v, s, st2 = (np.asarray(a, np.float64) for a in _run_state(m, codec, alg, x, st, fn))
    assert np.all(v == v[0]), "value differs between devices"
    div = N_DEV if fn is jcc.pmean else 1
    pos = jcc.state_positions(codec, n, jnp.float32, sizes, alg)
    assert pos.shape == (N_DEV, size)
    released = np.zeros(n)
    delta = div * (np.asarray(st, np.float64) - st2)
    np.add.at(released, pos[pos >= 0], delta[pos >= 0])
    np.testing.assert_allclose(s.sum(0) + released, div * v[0], rtol=1e-5, atol=2e-5)
    if size and not (alg == "sparse" and codec.value_codec is None):  # raw f32: exact
        assert np.abs(st2).max() > 0  # the stage's error went into the state
    # Every position of the tensor is held by at most one state element per
    # device, and (ring) by exactly one per device.
    for d in range(N_DEV):
        row = pos[d][pos[d] >= 0]
        assert len(np.unique(row)) == len(row)
        if alg == "ring":
            assert set(row) == set(range(n))


def test_ring_with_state_sends_the_input_itself(mesh):
    """Ring with a server residual: every step's error stays in the state,
    so a device's sent is its input."""
    codec = jc.codecs.OneBit(bucket_size=64)
    x = jax.random.normal(jax.random.key(3), (N_DEV, 500))
    st = jnp.zeros((N_DEV, jcc.state_size(codec, 500, jnp.float32, N_DEV, "ring")))
    _, s, _ = _run_state(mesh, codec, "ring", x, st)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x))


def test_server_state_is_checked(mesh):
    codec = jc.codecs.OneBit(bucket_size=64)
    x = jnp.ones((N_DEV, 1001))
    with pytest.raises(ValueError, match=r"state must be float32\[128\]"):
        _run_state(mesh, codec, "two_phase", x, jnp.zeros((N_DEV, 127)))
    with pytest.raises(ValueError, match="state must be float32"):
        _run_state(mesh, codec, "two_phase", x, jnp.zeros((N_DEV, 128), jnp.bfloat16))
    assert jcc.init_state(codec, (1001,), jnp.float32, N_DEV, "two_phase").shape == (128,)
    assert jcc.init_state(codec, (1001,), jnp.float32, 1, "two_phase").shape == (0,)


def test_without_state_the_result_is_unchanged(mesh):
    """state=None is the one-level algorithm, bit for bit as before: the
    second stage's error is in sent."""
    codec = jc.codecs.QSGD(bits=4, bucket_size=64)
    x = jax.random.normal(jax.random.key(4), (N_DEV, 1001))
    _, (v, s) = _run(mesh, codec, "two_phase", x)
    zero = jnp.zeros((N_DEV, jcc.state_size(codec, 1001, jnp.float32, N_DEV, "two_phase")))
    v2, s2, _ = _run_state(mesh, codec, "two_phase", x, zero)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(v2))  # same value from a zero state
    assert not np.array_equal(np.asarray(s), np.asarray(s2))  # the error moved out of sent


def test_auto_follows_the_codecs_recompression():
    """auto: allgather for TernGrad and 2-bit QSGD (unsafe) at any size, for
    coarse codecs up to 8 devices, two-phase for the rest."""
    choose = jcc.choose_algorithm
    assert choose(jc.codecs.TernGrad(), 4096, 64) == "allgather"
    assert choose(jc.codecs.QSGD(bits=2, bucket_size=128), 4096, 64) == "allgather"
    for codec in (jc.codecs.OneBit(), jc.codecs.SignSGD(), jc.codecs.ThreeLC(sparsity=1.5)):
        assert choose(codec, 4096, 8) == "allgather", codec
        assert choose(codec, 4096, 16) == "two_phase", codec
    for codec in (jc.codecs.QSGD(), jc.codecs.Int8(), jc.codecs.ThreeLC(), jc.codecs.Natural()):
        assert choose(codec, 4096, 8) == "two_phase", codec
    assert jcc.recompression_warning(jc.codecs.TernGrad(), "ring")
    assert jcc.recompression_warning(jc.codecs.TernGrad(), "allgather") is None
    assert jcc.recompression_warning(jc.codecs.OneBit(), "two_phase") is None


def test_codec_as_spec_string(mesh):
    """jc.psum takes a codec's spec string (or its class) as the codec."""
    x = jax.random.normal(jax.random.key(3), (N_DEV, 2048))
    _, want = _run(mesh, jc.codecs.QSGD(bits=4), "auto", x)
    for codec in ("qsgd:bits=4", jc.codecs.QSGD):
        _, got = _run(mesh, codec, "auto", x)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match="spec string"):
        _run(mesh, 4, "auto", x)


@pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
@pytest.mark.parametrize(
    "codec, alg",
    [(jc.codecs.QSGD(bits=4, bucket_size=64), "two_phase"), (jc.codecs.OneBit(), "ring")],
    ids=["qsgd-two_phase", "onebit-ring"],
)
def test_exported_for_cpu_and_cuda_gives_the_same_bytes(codec, alg):
    """A compressed psum under shard_map (typed varying axes checked),
    exported for the CPU and CUDA: where no CUDA kernels are built (a
    CPU-only machine) the CUDA branch traces the twins when it is lowered,
    inside the shard_map; run on the CPU the export gives the bytes of the
    program compiled for the CPU alone. (3LC's twins are left out: XLA:CPU fails a check compiling
    their CUDA branch, before and after kernel calls became one primitive.)"""
    mesh = jax.make_mesh(
        (4,), ("data",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )

    def f(x, k):
        r = jcc.psum(x[0], "data", codec, key=k, algorithm=alg)
        return r.value[None], r.sent[None]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"),) * 2))
    x = jax.device_put(
        jax.random.normal(jax.random.key(3), (4, 3001)),
        jax.sharding.NamedSharding(mesh, P("data")),
    )
    key = jax.device_put(KEY, jax.sharding.NamedSharding(mesh, P()))
    # jax 0.11 cannot call back any exported shard_map program under the
    # GSPMD partitioner, which the suite picks on that version (conftest.py):
    # its own Sharding custom call fails MLIR's verifier. Shardy can.
    with jax_config.use_shardy_partitioner(True):
        targets = set(re.findall(r"@(jaxcomp_\w+)", g.lower(x, key).as_text()))
        checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in sorted(targets)]
        exported = jax.export.export(g, platforms=("cpu", "cuda"), disabled_checks=checks)(x, key)
        for got, want in zip(exported.call(x, key), g(x, key), strict=True):
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize("size", [2, 3, 8])
def test_pairwise_exchange_is_the_all_to_all(size):
    """The all-to-all as size - 1 rounds of ppermute (the default where the
    devices belong to several CPU processes) moves every row where XLA's
    all-to-all does, bit for bit."""
    if len(jax.devices()) < size:
        pytest.skip(f"needs {size} devices")
    m = jax.make_mesh(
        (size,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:size]
    )
    for shape, dtype in [((size, 5), jnp.uint8), ((size, 3, 7), jnp.float32)]:
        x = (jnp.arange(size * np.prod(shape)).reshape(size, *shape) % 251).astype(dtype)

        def moved(fn, x):
            body = lambda a: fn(a[0], "data")[None]  # noqa: E731
            return jax.jit(jax.shard_map(body, mesh=m, in_specs=P("data"), out_specs=P("data")))(x)

        want = moved(lambda a, axis: jax.lax.all_to_all(a, axis, 0, 0), x)
        got = moved(jcc._exchange.pairwise, x)
        assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "codec", [jc.codecs.QSGD(bits=4, bucket_size=64), jc.codecs.TopK(fraction=0.05)], ids=repr
)
def test_pairwise_all_reduce_gives_the_same_bits(mesh, codec):
    """all_to_all="pairwise" changes how the rows travel, not what arrives:
    two-phase and the sparse all-reduce give the same value and sent, bit
    for bit, and two-phase's program holds ppermutes in place of the
    all-to-all; in one process "auto" is XLA's all-to-all."""
    alg = "sparse" if codec.rate is jc.codecs.Rate.SPARSE else "two_phase"
    x = jax.random.normal(jax.random.key(3), (N_DEV, 1001))
    results, texts = {}, {}
    for how in ("native", "pairwise", "auto"):
        fn = functools.partial(jcc.psum, all_to_all=how)
        g, results[how] = _run(mesh, codec, alg, x, fn=fn)
        texts[how] = g.lower(x, KEY).as_text()
    for a, b in zip(results["native"], results["pairwise"], strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert "all_to_all" not in texts["pairwise"]
    assert texts["auto"] == texts["native"]
    if alg == "two_phase":  # the sparse all-reduce of so few pairs all-gathers them
        assert "all_to_all" in texts["native"] and "collective_permute" in texts["pairwise"]


def test_all_to_all_argument_is_checked(mesh):
    fn = functools.partial(jcc.pmean, all_to_all="ring")
    with pytest.raises(ValueError, match="all_to_all must be one of"):
        _run(mesh, jc.codecs.QSGD(bits=4), "two_phase", jnp.ones((N_DEV, 64)), fn=fn)
