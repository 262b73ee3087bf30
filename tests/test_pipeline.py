"""The pipelined two-phase all-reduce (large tensors in segments): the same
bits as the unpipelined algorithm for deterministic codecs, conservation and
identical results for stochastic ones, and the segments' collectives in the
compiled HLO carrying the bytes of the unpipelined ones."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import registered_targets
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp import collectives as jcc
from jaxcomp.collectives import _two_phase as _core

N_DEV = 8
KEY = jax.random.key(3)
DETERMINISTIC = [
    jc.codecs.Int8(bucket_size=64),
    jc.codecs.OneBit(bucket_size=64),
    jc.codecs.Cast("bfloat16"),
    jc.codecs.FP8(format="e4m3"),
    jc.codecs.MX(element="e2m1"),
]


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N_DEV:
        pytest.skip(f"needs {N_DEV} devices")
    return jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.fixture
def small_segments(monkeypatch):
    """Pipelines tensors of a few thousand values (the default threshold
    needs millions)."""
    monkeypatch.setattr(_core, "PIPELINE_MIN_VALUES", 64)
    monkeypatch.setattr(_core, "PIPELINE_MAX_DEPTH", 4)


def _run(mesh, codec, x, fn, state=None):
    def f(x, st, k):
        r = fn(
            x[0], "data", codec, key=k, algorithm="two_phase", state=None if st is None else st[0]
        )
        return r.value[None], r.sent[None], (None if r.state is None else r.state[None])

    spec = P("data")
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec, P()), out_specs=spec))
    return g, [None if a is None else np.asarray(a) for a in g(x, state, KEY)]


def _state(codec, n):
    size = jcc.state_size(codec, n, jnp.float32, N_DEV, "two_phase")
    return 0.1 * jax.random.normal(jax.random.key(9), (N_DEV, size))


def test_depth_rule(monkeypatch):
    qsgd = jc.codecs.QSGD(bits=4, bucket_size=512)
    assert jcc.pipeline_depth(qsgd, 1 << 24, 4) == 1  # off by default
    monkeypatch.setattr(_core, "PIPELINE_MAX_DEPTH", 4)
    assert jcc.pipeline_depth(qsgd, 1 << 24, 4) == 4
    assert jcc.pipeline_depth(qsgd, 1 << 20, 4) == 1  # 2^18 per owner: too small to cut
    assert jcc.pipeline_depth(qsgd, 1 << 21, 4) == 2
    assert jcc.pipeline_depth(jc.codecs.ThreeLC(), 1 << 24, 4) == 1  # capacity tiers
    assert jcc.pipeline_depth(qsgd, 1 << 24, 1) == 1


@pytest.mark.parametrize(
    "codec, with_state, fn",
    [(c, st, jcc.psum) for c in DETERMINISTIC for st in (False, True)]
    + [(DETERMINISTIC[0], False, jcc.pmean), (DETERMINISTIC[1], True, jcc.pmean)],
    ids=lambda v: getattr(v, "__name__", repr(v)),
)
def test_deterministic_codecs_give_the_unpipelined_bits(mesh, monkeypatch, codec, with_state, fn):
    n = N_DEV * 2048 - 37
    x = jax.random.normal(jax.random.key(1), (N_DEV, n))
    state = _state(codec, n) if with_state else None
    monkeypatch.setattr(_core, "PIPELINE_MIN_VALUES", 64)
    monkeypatch.setattr(_core, "PIPELINE_MAX_DEPTH", 4)
    assert jcc.pipeline_depth(codec, n, N_DEV) == 4
    _, piped = _run(mesh, codec, x, fn, state)
    monkeypatch.setattr(_core, "PIPELINE_MAX_DEPTH", 1)
    assert jcc.pipeline_depth(codec, n, N_DEV) == 1
    _, plain = _run(mesh, codec, x, fn, state)
    for what, a, b in zip(("value", "sent", "state"), piped, plain, strict=True):
        if b is None:
            assert a is None
        elif what == "sent" and not with_state:
            # One-level: the owner's chunk of sent gets the second stage's
            # error added, and XLA may contract that sum with the decode
            # differently in the two programs: the last bit may differ.
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(np.abs(x).max()))
        else:
            assert a.tobytes() == b.tobytes(), f"{what} differs from the unpipelined algorithm"


@pytest.mark.parametrize("fn", [jcc.psum, jcc.pmean], ids=["psum", "pmean"])
def test_stochastic_codec_conserves(mesh, small_segments, monkeypatch, fn):
    codec = jc.codecs.QSGD(bits=4, bucket_size=64)
    n = N_DEV * 2048 - 37
    assert jcc.pipeline_depth(codec, n, N_DEV) == 4
    x = jax.random.normal(jax.random.key(2), (N_DEV, n))
    div = N_DEV if fn is jcc.pmean else 1
    exact = np.asarray(x, np.float64).sum(0) / div
    # One-level: what the devices sent adds up to div x the value.
    _, (v, s, _) = _run(mesh, codec, x, fn)
    assert np.all(v == v[0])
    np.testing.assert_allclose(s.astype(np.float64).sum(0), div * v[0], rtol=1e-5, atol=2e-5)
    assert np.linalg.norm(v[0] - exact) <= 0.6 * np.linalg.norm(exact)
    # Two-level: plus what the states released, at their positions.
    st = _state(codec, n)
    _, (v, s, st2) = _run(mesh, codec, x, fn, st)
    assert np.all(v == v[0])
    pos = jcc.state_positions(codec, n, jnp.float32, N_DEV, "two_phase")
    released = np.zeros(n)
    delta = div * (np.asarray(st, np.float64) - st2)
    np.add.at(released, pos[pos >= 0], delta[pos >= 0])
    np.testing.assert_allclose(
        s.astype(np.float64).sum(0) + released, div * v[0], rtol=1e-5, atol=2e-5
    )
    assert np.abs(st2).max() > 0
    # The first compression is the unpipelined one: the same bits.
    monkeypatch.setattr(_core, "PIPELINE_MAX_DEPTH", 1)
    _, (_, s1, _) = _run(mesh, codec, x, fn, st)
    assert s.tobytes() == s1.tobytes()


def test_segments_in_the_hlo_carry_the_unpipelined_bytes(mesh, small_segments):
    codec = jc.codecs.QSGD(bits=4, bucket_size=64)
    n = N_DEV * 2048
    x = jax.random.normal(jax.random.key(0), (N_DEV, n))
    g, _ = _run(mesh, codec, x, jcc.psum)
    hlo = g.lower(x, None, KEY).compile().as_text()
    counts = {k: len(re.findall(rf"\s{k}\(", hlo)) for k in ("all-to-all", "all-gather")}
    # QSGD's payload (the codes and the bucket norms) travels as one buffer.
    assert counts == {"all-to-all": 4, "all-gather": 4}
    sizes = {"u8": 1, "f32": 4}
    total: dict[str, int] = {}
    for kind in ("all-to-all", "all-gather"):
        for m in re.finditer(rf"=\s*(.*?)\s+{kind}\(", hlo):
            for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
                nbytes = sizes[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                total[kind] = total.get(kind, 0) + nbytes // (N_DEV if kind == "all-gather" else 1)
    assert total == jcc.operand_nbytes(codec, (n,), jnp.float32, N_DEV, "two_phase")


# ---------------------------------------------------------------------------
# Decode-and-accumulate of the received chunks (Codec.decode_sum)
# ---------------------------------------------------------------------------
DECODE_SUM_CODECS = [
    c
    for cls in jc.codecs.registered()
    if cls.decode_sum_kernel
    for c in cls.examples(coverage=True)
]


@pytest.mark.parametrize("rows, n", [(1, 1000), (3, 4099), (8, 70001)])
@pytest.mark.parametrize("codec", DECODE_SUM_CODECS, ids=repr)
def test_decode_sum_kernel_twin_and_rows_agree(codec, rows, n):
    xs = jnp.asarray(np.random.default_rng(rows).laplace(size=(rows, n)).astype(np.float32))
    xs = xs.at[0, :5].set(jnp.asarray([0.0, -0.0, 1e-40, -3e38, 7.0]))
    keys = jax.random.split(jax.random.key(rows), rows)
    payloads = jax.jit(jax.vmap(lambda x, k: codec.encode(x, k)))(xs, keys)
    kernel = np.asarray(jax.jit(lambda p: codec.decode_sum(p, backend="ffi"))(payloads))
    twin = np.asarray(jax.jit(lambda p: codec.decode_sum(p, backend="xla"))(payloads))
    decoded = [
        np.asarray(codec.decode(jax.tree.map(lambda a, i=i: a[i], payloads))) for i in range(rows)
    ]
    by_rows = decoded[0]
    for d in decoded[1:]:
        by_rows = by_rows + d  # float32, left to right
    assert kernel.dtype == np.float32 and kernel.shape == (n,)
    assert kernel.tobytes() == twin.tobytes()
    assert kernel.tobytes() == by_rows.tobytes()


@pytest.mark.parametrize("codec", DECODE_SUM_CODECS, ids=repr)
def test_the_collectives_decode_sum_is_the_rows_sum(codec):
    """What the collectives sum received payloads with (the kernel on the
    CPU, lowered per platform) gives the rows decoded and added in order,
    whatever the order of the codec's payload arrays."""
    from jaxcomp.collectives import _decode

    xs = jnp.asarray(np.random.default_rng(5).laplace(size=(3, 4099)).astype(np.float32))
    keys = jax.random.split(jax.random.key(5), 3)
    payloads = jax.jit(jax.vmap(lambda x, k: codec.encode(x, k)))(xs, keys)
    got = np.asarray(jax.jit(_decode.decode_sum)(payloads))
    rows = [np.asarray(codec.decode(jax.tree.map(lambda a, i=i: a[i], payloads))) for i in range(3)]
    assert got.tobytes() == ((rows[0] + rows[1]) + rows[2]).tobytes()


def test_the_decode_sum_flags_name_the_kernels_the_sources_register():
    """``decode_sum_kernel`` (the CPU module) and ``cuda_decode_sum_kernel``
    say which codecs' ``decode_sum`` targets are compiled: a flag without
    its target would fail at run time, a target without its flag would
    never run."""
    classes = jc.codecs.registered()
    assert {c.name for c in classes if c.decode_sum_kernel} == registered_targets(
        "ffi", "decode_sum"
    )
    assert {c.name for c in classes if c.cuda_decode_sum_kernel} == registered_targets(
        "cuda", "decode_sum"
    )
    assert {c.name for c in classes if c.decode_sum_kernel} >= {
        "qsgd", "int8", "onebit", "signsgd", "natural", "fp8", "mx", "terngrad", "cast"
    }  # fmt: skip


@pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
def test_the_cpu_all_reduce_sums_the_received_payloads_in_the_kernel():
    """On the CPU the allgather sums every device's OneBit payload with the
    decode-and-accumulate kernel: no decoded row per device is written."""
    codec = jc.codecs.OneBit()
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices("cpu")[:4])
    f = jax.jit(
        jax.shard_map(
            lambda x: jcc.pmean(x[0], "d", codec, algorithm="allgather").value[None],
            mesh=mesh,
            in_specs=P("d"),
            out_specs=P("d"),
        )
    )
    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (4, 4096)), jax.sharding.NamedSharding(mesh, P("d"))
    )
    hlo = f.lower(x).compile().as_text()
    assert '"jaxcomp_onebit_decode_sum"' in hlo
    assert '"jaxcomp_onebit_decode"' not in hlo


def test_decode_sum_of_other_codecs_and_errors():
    codec = jc.codecs.Identity()  # no kernel of its own: rows, then the sum
    assert not codec.decode_sum_kernel
    xs = jax.random.normal(jax.random.key(0), (3, 1000))
    payloads = jax.vmap(codec.encode)(xs)
    want = sum(
        np.asarray(codec.decode(jax.tree.map(lambda a, i=i: a[i], payloads))) for i in range(3)
    )
    got = np.asarray(codec.decode_sum(payloads))
    np.testing.assert_array_equal(got, want.astype(np.float32))
    with pytest.raises(ValueError, match="float32 payloads"):
        codec.decode_sum(jax.vmap(codec.encode)(xs.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="payload of"):
        jc.codecs.Cast(dtype="bfloat16").decode_sum(payloads)
