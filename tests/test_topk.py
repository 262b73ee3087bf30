"""TopK (SparCML, SC19): exact selection against a plain numpy reference,
both backends byte-identical, nested value codecs, wire round trips, and the
sparse pairs (the SparseCodec protocol) and the sparse scatter-add."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bytes, assert_same_payload, decode, encode, gradient_like

import jaxcomp as jc
from jaxcomp.codecs.base import Codec
from jaxcomp.collectives._sparse import scatter_add

TopK = jc.codecs.TopK
KEY = jax.random.key(3)
needs_ffi = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
BACKENDS = ["xla", pytest.param("ffi", marks=needs_ffi)]
_TINY = float(np.finfo(np.float32).tiny)


# ---------------------------------------------------------------------------
# The numpy reference: argsort by key, stable, so the lower index wins ties.
# ---------------------------------------------------------------------------
def _words(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


def _keys(x: np.ndarray) -> np.ndarray:
    w = _words(x)
    return (w & (0x7FFFFFFF if w.dtype == np.uint32 else 0x7FFF)).astype(np.int64)


def ref_select(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x| (as integer keys), ties to the lower
    index, ascending."""
    order = np.argsort(-_keys(x), kind="stable")
    return np.sort(order[:k])


def ref_payload(x: np.ndarray, codec) -> tuple[np.ndarray, np.ndarray]:
    """(indices, value words) as the codec must store them."""
    x = np.asarray(x).reshape(-1)
    n = x.size
    w = _words(x)
    if codec.k_per_bucket is None:
        k = 0 if n == 0 else min(n, max(1, math.floor(codec.fraction * n + 0.5)))
        idx = ref_select(x, k)
        return idx, w[idx]
    k, bucket = codec.k_per_bucket
    idxs, vals = [], []
    for b0 in range(0, n, bucket):
        seg = x[b0 : b0 + bucket]
        kb = min(k, seg.size)
        sel = ref_select(seg, kb)
        pad = np.arange(kb, k)  # the last bucket shorter than k: L .. k-1, value 0
        idxs.append(np.concatenate([sel, pad]))
        vals.append(np.concatenate([_words(seg)[sel], np.zeros(k - kb, w.dtype)]))
    if not idxs:
        return np.zeros(0, np.int64), np.zeros(0, w.dtype)
    return np.concatenate(idxs), np.concatenate(vals)


def check_exact(codec, x, backend, what=""):
    x = jnp.asarray(x)
    p = encode(x, KEY, codec, backend)
    idx, vals = ref_payload(np.asarray(x), codec)
    got_idx = np.asarray(p["indices"])
    np.testing.assert_array_equal(got_idx.astype(np.int64), idx, err_msg=f"{what} indices")
    np.testing.assert_array_equal(_words(np.asarray(p["values"])), vals, err_msg=f"{what} values")
    # Decoding is the input at the kept positions and zero elsewhere.
    dense = np.zeros(x.size, _words(np.asarray(x)).dtype)
    n = x.size
    if codec.k_per_bucket is None:
        dense[idx] = vals
    else:
        k, bucket = codec.k_per_bucket
        g = (np.arange(idx.size) // k) * bucket + idx
        keep = g < n
        dense[g[keep]] = vals[keep]
    y = decode(p, backend)
    np.testing.assert_array_equal(
        _words(np.asarray(y).reshape(-1)), dense, err_msg=f"{what} decode"
    )
    return p


def special_inputs(n: int, dtype, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {
        "gradient": np.asarray(gradient_like(n, seed=seed, dtype=dtype)),
        # few distinct magnitudes, both signs: ties everywhere, at every threshold
        "ties": (rng.integers(-3, 4, n) * 0.5).astype(np.float32),
        "all_equal": np.full(n, -1.5, np.float32),
        "zeros": np.zeros(n, np.float32),
        "signed_zeros": np.where(rng.random(n) < 0.5, -0.0, 0.0).astype(np.float32),
    }
    nonfinite = rng.standard_normal(n).astype(np.float32)
    if n:
        nonfinite[rng.integers(0, n, size=max(1, n // 40))] = np.inf
        nonfinite[rng.integers(0, n, size=max(1, n // 40))] = -np.inf
        nonfinite[rng.integers(0, n, size=max(1, n // 40))] = np.nan
        nonfinite[rng.integers(0, n, size=max(1, n // 80))] = -np.nan
    out["nonfinite"] = nonfinite
    return {k: np.asarray(jnp.asarray(v).astype(dtype)) for k, v in out.items()}


CONFIGS = [
    TopK(fraction=0.01),
    TopK(fraction=0.3),
    TopK(fraction=1.0),  # k = n
    TopK(fraction=1e-9),  # k = 1
    TopK(k_per_bucket=(8, 512)),
    TopK(k_per_bucket=(3, 8)),
    TopK(k_per_bucket=(16, 16)),  # k = bucket
    TopK(k_per_bucket=(100, 256)),
    TopK(k_per_bucket=(700, 1024)),
]


# Sizes with the dtype each runs in: every dtype with small, odd and
# multi-chunk sizes.
SIZES = [
    (1, "float16"),
    (7, "bfloat16"),
    (256, "float32"),
    (257, "float16"),
    (4099, "bfloat16"),
    (70001, "float32"),
]


@pytest.mark.parametrize("codec", CONFIGS, ids=repr)
def test_exact_against_numpy_on_both_backends(codec):
    """The kernel against the numpy reference, and the twin against the
    kernel byte for byte, on inputs with ties at every threshold, equal
    values, zeros of both signs and non-finite values."""
    for n, dtype in SIZES:
        for name, x in special_inputs(n, dtype, seed=n).items():
            what = f"{codec!r} {dtype} n={n} {name}"
            p = check_exact(codec, x, "auto", what)
            if jc.cpu_available():
                assert_same_payload(p, encode(jnp.asarray(x), KEY, codec, "xla"), what)
                assert_same_bytes(decode(p, "ffi"), decode(p, "xla"), f"{what} decode")


def _large_inputs(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    x = {"gradient": np.asarray(gradient_like(n, seed=4))}
    # Ties at the threshold spread over every chunk and thread: 90% ones, 10%
    # twos, and k falls inside the twos (and, for the whole tensor at 20%,
    # inside the ones).
    x["ties"] = np.where(rng.random(n) < 0.1, 2.0, 1.0).astype(np.float32)
    x["mostly_zero"] = np.where(rng.random(n) < 0.003, rng.standard_normal(n), 0.0).astype(
        np.float32
    )
    # Large values only in a few evenly spaced short runs, small elsewhere:
    # a strided sample of the input overestimates the threshold.
    runs = np.zeros(n, bool)
    stride = n // 256
    for b in range(256):
        runs[b * stride : b * stride + 256] = True
    x["runs"] = np.where(runs, 100.0 + rng.random(n), rng.random(n)).astype(np.float32)
    # Ascending magnitudes: the k largest are the last k.
    x["ramp"] = np.linspace(-1.0, 1.0, n).astype(np.float32) ** 3
    return x


@pytest.mark.parametrize(
    "codec, dtype",
    [
        (TopK(fraction=0.01), "float32"),
        (TopK(fraction=0.2), "bfloat16"),
        (TopK(fraction=0.001), "float32"),
        (TopK(k_per_bucket=(8, 512)), "bfloat16"),
    ],
    ids=repr,
)
def test_large_inputs_exact(codec, dtype):
    """Several times 2^16 elements (and over 2^20), so that the threaded and
    sampled paths of the kernel run (the twin is one lax.top_k)."""
    n = (1 << 20) + 4099
    for name, x in _large_inputs(n).items():
        check_exact(codec, jnp.asarray(x).astype(dtype), "auto", f"{codec!r} {dtype} {name}")


@needs_ffi
def test_large_float16_and_ties_byte_identical():
    n = 5 * 65536 + 17
    for name, x in _large_inputs(n).items():
        for codec in (TopK(fraction=0.05), TopK(k_per_bucket=(5, 64))):
            xx = jnp.asarray(x).astype(jnp.float16)
            assert_same_payload(
                encode(xx, KEY, codec, "ffi"), encode(xx, KEY, codec, "xla"), f"{name} {codec!r}"
            )


def test_nan_ranks_above_inf_and_is_kept():
    x = np.array([1.0, np.inf, 3.0, np.nan, -np.inf, -np.nan, 2.0, 0.0], np.float32)
    for backend in ("xla", "ffi") if jc.cpu_available() else ("xla",):
        p = TopK(fraction=0.25).encode(x, backend=backend)  # k = 2
        assert np.asarray(p["indices"]).tolist() == [3, 5]
        p = TopK(fraction=0.5).encode(x, backend=backend)  # k = 4: NaNs, then Infs
        assert np.asarray(p["indices"]).tolist() == [1, 3, 4, 5]
        y = np.asarray(TopK(fraction=0.5).decode(p, backend=backend))
        assert np.isnan(y[3]) and np.isnan(y[5]) and y[1] == np.inf and y[4] == -np.inf
        assert np.all(y[[0, 2, 6, 7]] == 0)


def test_ties_go_to_the_lower_index():
    x = np.array([1.0, -2.0, 2.0, -2.0, 1.0, 2.0], np.float32)
    for backend in ("xla", "ffi") if jc.cpu_available() else ("xla",):
        p = TopK(fraction=0.5).encode(x, backend=backend)  # k = 3 of four 2s
        assert np.asarray(p["indices"]).tolist() == [1, 2, 3]


# ---------------------------------------------------------------------------
# Configuration, layout, k.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(fraction=0.0), "fraction"),
        (dict(fraction=1.5), "fraction"),
        (dict(fraction=-0.1), "fraction"),
        (dict(fraction=float("nan")), "fraction"),
        (dict(fraction=True), "fraction"),
        (dict(fraction="0.1"), "fraction"),
        (dict(fraction=0.1, k_per_bucket=(8, 512)), "not both"),
        (dict(k_per_bucket=(0, 512)), "k"),
        (dict(k_per_bucket=(513, 512)), "k"),
        (dict(k_per_bucket=(8, 500)), "bucket_size"),
        (dict(k_per_bucket=(2, 4)), "bucket_size"),
        (dict(k_per_bucket=(2, 1 << 17)), "bucket_size"),
        (dict(k_per_bucket=(2.0, 512)), "k"),
        (dict(k_per_bucket=8), "k_per_bucket"),
        (dict(value_codec="qsgd"), "value_codec"),
        (dict(value_codec=TopK(fraction=0.5)), "value_codec"),
    ],
)
def test_invalid_configuration(kw, param):
    with pytest.raises(ValueError, match=param):
        TopK(**kw)


def test_variable_rate_value_codec_is_rejected():
    variable = [
        jc.codecs.get(n)
        for n in jc.codecs.names()
        if type(jc.codecs.get(n)).used_nbytes is not jc.codecs.Codec.used_nbytes
    ]
    for c in variable:
        with pytest.raises(ValueError, match="fixed-rate"):
            TopK(value_codec=c)


def test_default_and_normalization():
    assert TopK() == TopK(fraction=0.01) == jc.codecs.get("topk")
    assert TopK(k_per_bucket=[8, 512]) == TopK(k_per_bucket=(8, 512))
    assert hash(TopK(fraction=1)) == hash(TopK(fraction=1.0))
    assert not TopK().stochastic
    assert TopK(value_codec=jc.codecs.QSGD(bits=4)).stochastic
    assert not TopK(value_codec=jc.codecs.Int8()).stochastic


@pytest.mark.parametrize(
    "fraction, n, k",
    [
        (0.01, 100, 1),
        (0.07, 100, 7),
        (0.01, 1 << 24, 167772),
        (0.5, 3, 2),
        (0.5, 1, 1),
        (1e-9, 10, 1),
        (1.0, 7, 7),
        (0.01, 0, 0),
        (0.25, 6, 2),
        (0.3, 5, 2),
    ],
)
def test_k_of_fraction(fraction, n, k):
    assert TopK(fraction=fraction).selection(n) == (k, 0)


@pytest.mark.parametrize(
    "codec, n, dtype",
    [
        (TopK(fraction=0.5), 256, np.uint8),
        (TopK(fraction=0.5), 257, np.uint16),
        (TopK(fraction=0.5), 65536, np.uint16),
        (TopK(fraction=0.01), 65537, np.uint32),
        (TopK(k_per_bucket=(4, 256)), 100000, np.uint8),
        (TopK(k_per_bucket=(4, 512)), 100, np.uint16),
        (TopK(k_per_bucket=(4, 65536)), 10, np.uint16),
    ],
)
def test_index_dtype(codec, n, dtype):
    assert codec.layout((n,))["indices"].dtype == dtype


def test_layout_sizes_and_padding():
    c = TopK(k_per_bucket=(8, 16))
    assert c.layout((35,))["indices"].shape == (24,)  # 3 buckets, the last of 3 elements
    x = jnp.arange(1.0, 36.0)
    p = c.encode(x)
    idx = np.asarray(p["indices"])
    assert idx[16:].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # 3 real, then padding 3 .. 7
    assert np.asarray(p["values"])[19:].tolist() == [0.0] * 5
    assert c.wire_nbytes((35,)) == 24 * (1 + 4)
    assert TopK(fraction=0.01).wire_nbytes((0,)) == 0


def test_empty_and_scalar():
    for c in (TopK(), TopK(k_per_bucket=(8, 512)), TopK(value_codec=jc.codecs.QSGD(bits=4))):
        for shape in [(0,), (2, 0), ()]:
            x = jnp.ones(shape, jnp.float32) * 3.0
            p = c.encode(x, KEY)
            y = c.decode(p)
            assert y.shape == shape
            # Exact without a value codec; QSGD's 7 * (3 * float32(1/7)) is 3 - 1 ulp.
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6)


# ---------------------------------------------------------------------------
# Nested value codecs.
# ---------------------------------------------------------------------------
NESTED = [
    jc.codecs.QSGD(bits=4),
    jc.codecs.QSGD(bits=2, bucket_size=8, norm="l2"),
    jc.codecs.Int8(bucket_size=64),
    jc.codecs.Cast("bfloat16"),
    jc.codecs.Cast("float16"),
    jc.codecs.OneBit(bucket_size=8),
    jc.codecs.Natural(),
    jc.codecs.Natural(stochastic=False),
    jc.codecs.TernGrad(bucket_size=16),
    jc.codecs.Identity(),
]


@pytest.mark.parametrize(
    "vc, mode",
    [(vc, [dict(fraction=0.05), dict(k_per_bucket=(8, 64))][i % 2]) for i, vc in enumerate(NESTED)],
    ids=repr,
)
def test_nested_value_codec(vc, mode):
    x = gradient_like(5003, seed=2)
    plain = TopK(**mode)
    c = TopK(**mode, value_codec=vc)
    assert c.stochastic == vc.stochastic
    p = c.encode(x, KEY)
    q = plain.encode(x)
    assert_same_bytes(p["indices"], q["indices"], "indices as without a value codec")
    assert [k for k in p.arrays if k != "indices"] == ["values." + k for k in vc.layout((1,))]
    # The kept values decode as the value codec decodes them.
    values = q["values"]
    expect = vc.decode(vc.encode(values, KEY))
    got = c.values(p)
    assert_same_bytes(got, expect, "nested decode")
    # ... and land at the kept indices, zero elsewhere.
    y = np.asarray(c.decode(p))
    g, v = p.codec.pairs(p)
    dense = np.asarray(scatter_add(g, v, x.size))
    np.testing.assert_allclose(y, dense, rtol=0, atol=_TINY)  # subnormals may flush
    # Wire: the nested codec is rebuilt from the params.
    r = jc.wire.from_bytes(jc.wire.to_bytes(p))
    assert r.codec == c and r.codec.value_codec == vc
    assert_same_payload(r, p, "wire round trip")
    # Both backends give the same bytes.
    if jc.cpu_available():
        assert_same_payload(c.encode(x, KEY, backend="ffi"), c.encode(x, KEY, backend="xla"))


def test_qsgd_values_within_bound():
    x = gradient_like(20000, seed=8)
    c = TopK(fraction=0.05, value_codec=jc.codecs.QSGD(bits=4, bucket_size=512))
    p = c.encode(x, KEY)
    v = np.asarray(TopK(fraction=0.05).encode(x)["values"], np.float32)
    got = np.asarray(c.values(p), np.float32)
    s = 7  # 2^(bits-1) - 1 levels
    for b0 in range(0, v.size, 512):
        scale = np.max(np.abs(v[b0 : b0 + 512]))
        assert np.all(np.abs(got[b0 : b0 + 512] - v[b0 : b0 + 512]) <= scale / s * (1 + 1e-6))


def test_stochastic_nested_needs_a_key():
    c = TopK(value_codec=jc.codecs.QSGD(bits=4))
    with pytest.raises(ValueError, match="PRNG key"):
        c.encode(jnp.ones(100))


# ---------------------------------------------------------------------------
# Wire format.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "codec",
    [
        TopK(fraction=0.01),
        TopK(fraction=1 / 3),
        TopK(k_per_bucket=(8, 512)),
        TopK(k_per_bucket=(16, 512), value_codec=jc.codecs.QSGD(bits=4)),
        TopK(fraction=0.05, value_codec=jc.codecs.Natural(stochastic=False, bucket_size=8)),
    ],
    ids=repr,
)
def test_wire_params_round_trip(codec):
    params = codec.wire_params()
    assert TopK.from_wire_params(params) == codec
    x = gradient_like(777, seed=1, dtype="bfloat16")
    p = codec.encode(x, KEY)
    r = jc.wire.from_bytes(jc.wire.to_bytes(p))
    assert r.codec == codec
    assert_same_payload(r, p)
    assert_same_bytes(codec.decode(r), codec.decode(p))


@pytest.mark.parametrize(
    "params",
    [
        (2, 8, 512, -1),  # unknown mode
        (1, 8, 512, 99),  # unknown value codec
        (1, 8, 512, -1, 4),  # params after "none"
        (0, 4607182418800017408, 1, -1),  # fraction mode with b != 0
        (0, 0, 0, -1),  # fraction 0.0
        (1, 0, 512, -1),  # k = 0
        (1, 8, 512, 8, 1, 8, 512, -1),  # TopK inside TopK
        (1, 8, 512),  # too short
    ],
)
def test_bad_wire_params_are_rejected(params):
    with pytest.raises(ValueError):
        TopK.from_wire_params(params)


# ---------------------------------------------------------------------------
# Sparse pairs and scatter-add.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "codec",
    [
        TopK(fraction=0.03),
        TopK(k_per_bucket=(12, 16)),
        TopK(k_per_bucket=(5, 8), value_codec=jc.codecs.Int8()),
    ],
    ids=repr,
)
def test_sparse_pairs_batched(codec):
    n = 1003  # the last bucket of 16 is 11 long, of 8 3 long: padding entries
    xs = jnp.stack([gradient_like(n, seed=s) for s in range(5)]).reshape(5, 1, n)
    ps = jax.vmap(jax.vmap(lambda x: codec.encode(x)))(xs)
    g, v = jax.jit(codec.pairs)(ps)
    m = ps["indices"].shape[-1]
    assert g.shape == (5, 1, m) and g.dtype == jnp.int32 and v.dtype == jnp.float32
    pad = np.asarray(g) == n
    assert np.all(np.asarray(v)[pad] == 0)
    assert np.all((np.asarray(g) >= 0) & (np.asarray(g) <= n))
    for i in range(5):
        row = np.asarray(g[i, 0])
        real = row[row < n]
        assert np.all(np.diff(real) > 0), "ascending, no duplicates"
        p = codec.encode(xs[i, 0])
        dense = np.asarray(codec.decode(p), np.float32)
        # float32 additions: XLA's CPU flushes the subnormals among the values.
        np.testing.assert_allclose(
            np.asarray(scatter_add(g[i], v[i], n)), dense, rtol=0, atol=_TINY
        )
        assert np.count_nonzero(~pad[i]) == real.size
    if codec.k_per_bucket is not None:
        k, bucket = codec.k_per_bucket
        expected_pad = max(0, k - n % bucket) if n % bucket else 0
        assert np.count_nonzero(pad[0]) == expected_pad > 0
    # Sum over the batch: the sparse all-gather reduction.
    total = np.asarray(jax.jit(scatter_add, static_argnums=2)(g, v, n))
    expect = sum(np.asarray(codec.decode(codec.encode(xs[i, 0])), np.float64) for i in range(5))
    np.testing.assert_allclose(total, expect, rtol=1e-6, atol=1e-6 * np.max(np.abs(expect)))


def test_scatter_add_sums_duplicates_and_drops_padding():
    idx = jnp.array([[0, 2, 5], [2, 3, 5]], jnp.int32)
    val = jnp.array([[1.0, 2.0, 9.0], [3.0, 4.0, 7.0]], jnp.float32)
    out = scatter_add(idx, val, 5)  # index 5 == n: padding
    np.testing.assert_array_equal(np.asarray(out), [1.0, 0.0, 5.0, 4.0, 0.0])


def test_kernel_rejects_bad_attributes():
    if not jc.cpu_available():
        pytest.skip("CPU kernels not built")
    x = jnp.ones(100)
    with pytest.raises(Exception, match="k must be"):
        _topk_kernel(x, 101, 0)
    with pytest.raises(Exception, match="bucket_size"):
        _topk_kernel(x, 2, 12)


def _topk_kernel(x, k, bucket):
    results = (jax.ShapeDtypeStruct((k,), jnp.uint8), jax.ShapeDtypeStruct((k,), x.dtype))
    return Codec.kernel("ffi", "jaxcomp_topk_encode", None, (x,), results, k=k, bucket_size=bucket)
