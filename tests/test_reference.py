"""Fixed-rate codecs against straightforward numpy implementations of the
papers' definitions (exact, byte for byte)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import decode, encode

import jaxcomp as jc

M32 = np.uint64(0xFFFFFFFF)


def np_mix32(x):
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & M32
    x ^= x >> np.uint64(16)
    return x


def np_uniform(k0, k1, index):
    a = np_mix32(np.array([k0], np.uint64))[0]
    b = np_mix32(np.array([k1], np.uint64) ^ a)[0]
    h = np_mix32(((index.astype(np.uint64) + a) & M32) ^ b)
    return (h >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)


def np_pack(codes, bits):
    """Code i at bit offset i*bits of a little-endian bit stream."""
    if bits == 8:
        return codes.astype(np.uint8)
    stream = np.zeros(codes.size * bits, np.uint8)
    for b in range(bits):
        stream[b::bits] = (codes >> b) & 1
    return np.packbits(stream, bitorder="little")


def np_tree_sum(a):
    a = a.copy()
    w = a.size // 2
    while w >= 1:
        a = a[:w] + a[w : 2 * w]
        w //= 2
    return a[0]


def np_exact_square(v):
    """qsgd.h exact_square: v^2 from three exact products (within 2^-23 of v*v)."""
    h = (v.view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)
    lo = v - h
    sq = (h * h + (h * lo) * np.float32(2)) + lo * lo
    np.testing.assert_allclose(sq, v.astype(np.float64) ** 2, rtol=2.5e-7)
    return sq


def plain_inputs(n, seed):
    """Normal-range float32 (no subnormals: numpy does not flush them, XLA does)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)


def buckets(x, bucket):
    nb = -(-x.size // bucket)
    return np.pad(x, (0, nb * bucket - x.size)).reshape(nb, bucket)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("norm", ["max", "l2"])
@pytest.mark.parametrize("n", [37, 1000])
def test_qsgd_matches_the_paper(bits, norm, n):
    """Section 2.3 of the low-precision study: level l with |v|/||v|| in
    [l/s, (l+1)/s], rounded up with probability |v|/||v||*s - l."""
    bucket = 64
    codec = jc.codecs.QSGD(bits=bits, bucket_size=bucket, norm=norm)
    x = plain_inputs(n, seed=bits * n)
    key = jax.random.key(11)
    k0, k1 = (int(w) for w in jax.random.key_data(key))
    s = 2 ** (bits - 1) - 1
    xb = buckets(x, bucket)
    codes, scales = [], []
    for b, v in enumerate(xb):
        scale = np.sqrt(np_tree_sum(np_exact_square(v))) if norm == "l2" else np.max(np.abs(v))
        scale = np.float32(scale)
        scales.append(scale)
        r = np.minimum(np.abs(v) * (np.float32(s) / scale), np.float32(s))
        lower = np.floor(r)
        u = np_uniform(k0, k1, np.arange(b * bucket, (b + 1) * bucket))
        level = np.minimum(lower + (u < r - lower), s).astype(np.uint8)
        codes.append(((v < 0).astype(np.uint8) << (bits - 1)) | level)
    p = encode(jnp.asarray(x), key, codec)
    np.testing.assert_array_equal(np.asarray(p["scales"]), np.array(scales, np.float32))
    np.testing.assert_array_equal(np.asarray(p["codes"]), np_pack(np.concatenate(codes), bits))
    # Decode: sign * level * scale / s.
    c = np.concatenate(codes).reshape(-1, bucket).astype(np.float32)
    level = np.mod(c, 2 ** (bits - 1))
    step = np.array(scales, np.float32) * (np.float32(1) / np.float32(s))
    expect = np.where(c >= 2 ** (bits - 1), -(level * step[:, None]), level * step[:, None])
    np.testing.assert_array_equal(np.asarray(decode(p)), expect.reshape(-1)[:n])


@pytest.mark.parametrize("bucket", [8, 64, 512])
@pytest.mark.parametrize("n", [5, 64, 1000, 4097])
def test_onebit_matches_seide(bucket, n):
    """avg+ over v >= 0 and avg- over v < 0 of each bucket (study section 2.2)."""
    codec = jc.codecs.OneBit(bucket_size=bucket)
    x = plain_inputs(n, seed=n)
    p = encode(jnp.asarray(x), None, codec)
    xb = buckets(x, bucket)
    valid = buckets(np.ones(n, bool), bucket)
    means = []
    for v, ok in zip(xb, valid, strict=True):
        pos, neg = ok & (v >= 0), ok & (v < 0)
        hi = np_tree_sum(np.where(pos, v, 0)) / np.float32(max(pos.sum(), 1))
        lo = np_tree_sum(np.where(neg, v, 0)) / np.float32(max(neg.sum(), 1))
        means += [hi if pos.any() else 0, lo if neg.any() else 0]
        # The tree order is a choice; the value is the plain mean to rounding.
        if pos.any():
            np.testing.assert_allclose(hi, v[pos].astype(np.float64).mean(), rtol=2e-6)
    np.testing.assert_array_equal(np.asarray(p["means"]), np.array(means, np.float32))
    np.testing.assert_array_equal(
        np.asarray(p["bits"]), np.packbits(xb.reshape(-1) >= 0, bitorder="little")
    )
    m = np.array(means, np.float32).reshape(-1, 2)
    expect = np.where(xb >= 0, m[:, :1], m[:, 1:]).reshape(-1)[:n]
    np.testing.assert_array_equal(np.asarray(decode(p)), expect)


@pytest.mark.parametrize("bucket", [8, 512])
@pytest.mark.parametrize("n", [3, 1000, 4097])
def test_int8_matches_the_definition(bucket, n):
    codec = jc.codecs.Int8(bucket_size=bucket)
    x = plain_inputs(n, seed=n + 1)
    x[: min(n, 4)] = [0.5, -0.5, 1.5, 2.5][: min(n, 4)]  # ties go to even
    p = encode(jnp.asarray(x), None, codec)
    xb = buckets(x, bucket)
    m = np.max(np.abs(xb), axis=1)
    q = np.round(xb * (np.float32(127) / m)[:, None]).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(p["scales"]), m)
    np.testing.assert_array_equal(np.asarray(p["q"]), q.reshape(-1))
    assert np.abs(q).max() <= 127
    step = m * (np.float32(1) / np.float32(127))
    np.testing.assert_array_equal(np.asarray(decode(p)), (q * step[:, None]).reshape(-1)[:n])
    # Round to nearest: the error is at most half a step (plus float rounding).
    err = np.abs(np.asarray(decode(p)) - x)
    assert np.all(err <= np.repeat(step, bucket)[:n] * np.float32(0.5 + 1e-5))


@pytest.mark.parametrize("target", ["bfloat16", "float16"])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_cast_is_round_to_nearest_even(target):
    x = plain_inputs(5000, seed=3)
    x[:4] = [65519.0, 65520.0, 1e-7, -3e-8]  # f16 overflow boundary and subnormals
    p = encode(jnp.asarray(x), None, jc.codecs.Cast(target))
    np.testing.assert_array_equal(
        np.asarray(p["values"]).view(np.uint16), x.astype(jnp.dtype(target)).view(np.uint16)
    )
    np.testing.assert_array_equal(
        np.asarray(decode(p)), x.astype(jnp.dtype(target)).astype(np.float32)
    )


def np_base3_pack(t):
    """The 3LC paper's base-3^5 encoding (section 3.2, steps 1-5), plainly."""
    d = (t + 1).astype(np.uint8)  # (1), (2): shift to {0, 1, 2}, uint8
    d = d.reshape(-1)  # (3) flatten
    d = np.concatenate([d, np.ones(-d.size % 5, np.uint8)])  # (4) pad with zeros (digit 1)
    p = d.reshape(5, -1).astype(np.int64)  # (5) five equal planes P0..P4
    out = p[0] * 81 + p[1] * 27 + p[2] * 9 + p[3] * 3 + p[4]
    assert out.max(initial=0) <= 242
    return out.astype(np.uint8)


@pytest.mark.parametrize("bucket", [8, 64, 512])
@pytest.mark.parametrize("n", [1, 5, 37, 1000, 4097])
def test_terngrad_matches_the_paper(bucket, n):
    """Wen et al. 2017: t = sign(v) * b, b ~ Bernoulli(|v| / max|v|) per
    bucket; decode t * max|v|. Trits packed as 3LC section 3.2."""
    codec = jc.codecs.TernGrad(bucket_size=bucket)
    x = plain_inputs(n, seed=n + bucket)
    key = jax.random.key(5)
    k0, k1 = (int(w) for w in jax.random.key_data(key))
    xb = buckets(x, bucket)
    scale = np.max(np.abs(xb), axis=1)
    inv = np.float32(1) / scale
    r = np.abs(xb) * inv[:, None]
    u = np_uniform(k0, k1, np.arange(xb.size)).reshape(xb.shape)
    t = np.where(u < r, np.sign(xb), 0).astype(np.int8).reshape(-1)[:n]
    p = encode(jnp.asarray(x), key, codec)
    np.testing.assert_array_equal(np.asarray(p["scales"]), scale)
    np.testing.assert_array_equal(np.asarray(p["trits"]), np_base3_pack(t))
    expect = t.astype(np.float32) * np.repeat(scale, bucket)[:n]
    np.testing.assert_array_equal(np.asarray(decode(p)), expect)
    # Both backends read any byte (also 243..255, never written) the same way.
    junk = jc.Payload(
        codec,
        p.shape,
        p.dtype,
        {"trits": jnp.asarray(np.arange(p["trits"].size) % 256, jnp.uint8), "scales": p["scales"]},
    )
    for backend in ("ffi", "xla") if jc.cpu_available() else ("xla",):
        got = np.asarray(decode(junk, backend))
        b = np.arange(p["trits"].size) % 256
        digits = np.concatenate([(b // 3 ** (4 - j)) % 3 for j in range(5)])[:n]
        np.testing.assert_array_equal(
            got, (digits - 1.0).astype(np.float32) * np.repeat(scale, bucket)[:n]
        )


def test_base3_packing_of_five_zeros_is_121():
    codec = jc.codecs.TernGrad(bucket_size=8)
    p = encode(jnp.zeros((10,), jnp.float32), jax.random.key(0), codec)
    np.testing.assert_array_equal(np.asarray(p["trits"]), [121, 121])
    # One value: planes of one digit each, four of them padding.
    p = encode(jnp.asarray([-3.0]), jax.random.key(0), codec)
    assert int(p["trits"][0]) == 0 * 81 + 27 + 9 + 3 + 1


def np_natural(x, bucket, cap_exp=127, bits=None):
    """Natural compression with the codec's finite range, written with frexp:
    deterministic (nearest, midpoint up) when bits is None, else stochastic
    with P(up) = mantissa / 2^23 decided by the 32 random bits of the element.
    Returns the decoded values and the per-bucket top biased exponent."""
    xb = buckets(x, bucket).astype(np.float32)
    mag = np.abs(xb).astype(np.float64)
    normal = np.isfinite(mag) & (mag >= 2.0**-126)
    # |v| in [2^a, 2^(a+1)) for normal values.
    a = np.where(normal, np.frexp(np.where(normal, mag, 1.0))[1] - 1, -1000)
    top_a = np.max(np.where(np.isfinite(mag) & normal, a, -127), axis=1)  # bucket's max exponent
    low = (top_a - 62)[:, None]  # smallest representable power 2^low
    p_up = np.where(normal, mag / 2.0**a - 1, 0)  # = mantissa / 2^23, exact
    if bits is None:
        up = p_up >= 0.5
        under_up = a == low - 1  # |v| in [2^low / 2, 2^low): nearer to 2^low (tie up)
    else:
        bits = bits.reshape(xb.shape).astype(np.float64)
        up = np.floor(bits / 512) < p_up * 2**23
        under_up = bits < mag / 2.0**low * 2**32  # P = |v| / 2^low
    k = np.minimum(a + up, cap_exp)
    out = np.where(a < low, np.where(under_up, 2.0**low, 0.0), 2.0**k)
    out = np.where(normal, out, 0.0) * np.sign(xb)
    out = np.where(np.isnan(xb), np.nan, np.where(np.isinf(xb), xb, out))
    return out.astype(np.float32).reshape(-1)[: x.size], (top_a + 128).astype(np.uint8)


def natural_specials():
    return np.array(
        [1.5, 3.0, -1.5, 1.4999999, 0.75, 1.0, -0.0, 0.0, 3e-39, -3e-39, 2.0**-63, 2.0**-64,
         1.5 * 2.0**-64, 2.0**-80, np.inf, -np.inf, np.nan, 3e38, -3e38, 2.0**127, 6.0],
        np.float32,
    )  # fmt: skip


@pytest.mark.parametrize("bucket", [8, 64, 512])
@pytest.mark.parametrize("n", [3, 1000, 4097])
def test_natural_deterministic_matches_the_definition(bucket, n):
    """Nearest power of two, the midpoint 1.5 * 2^a rounding up; values more
    than 63 binades below the bucket's top go to 0 or the smallest power."""
    codec = jc.codecs.Natural(stochastic=False, bucket_size=bucket)
    x = plain_inputs(n, seed=n * 3 + bucket)
    sp = natural_specials()
    x[: min(n, sp.size)] = sp[: min(n, sp.size)]
    p = encode(jnp.asarray(x), None, codec)
    expect, tops = np_natural(x, bucket)
    np.testing.assert_array_equal(np.asarray(p["tops"]), tops)
    np.testing.assert_array_equal(np.asarray(decode(p)), expect)


@pytest.mark.parametrize("bucket", [8, 512])
@pytest.mark.parametrize("n", [3, 1000, 4097])
def test_natural_stochastic_matches_the_definition(bucket, n):
    codec = jc.codecs.Natural(bucket_size=bucket)
    x = plain_inputs(n, seed=n * 5 + bucket)
    sp = natural_specials()
    x[: min(n, sp.size)] = sp[: min(n, sp.size)]
    key = jax.random.key(9)
    k0, k1 = (int(w) for w in jax.random.key_data(key))
    a = np_mix32(np.array([k0], np.uint64))[0]
    b = np_mix32(np.array([k1], np.uint64) ^ a)[0]
    idx = np.arange(-(-n // bucket) * bucket, dtype=np.uint64)
    bits = np_mix32(((idx + a) & M32) ^ b)
    p = encode(jnp.asarray(x), key, codec)
    expect, tops = np_natural(x, bucket, bits=bits)
    np.testing.assert_array_equal(np.asarray(p["tops"]), tops)
    np.testing.assert_array_equal(np.asarray(decode(p)), expect)


def test_natural_codes_and_special_values():
    """The byte layout of docs/codecs.md: sign, zero/special flag, exponent
    below the bucket's top; midpoints round up; NaN and +-inf keep their place."""
    codec = jc.codecs.Natural(stochastic=False, bucket_size=8)
    x = np.array([1.5, -1.5, 1.0, 0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)
    p = encode(jnp.asarray(x), None, codec)
    assert int(p["tops"][0]) == 128  # max finite |v| = 1.5: biased exponent 127, + 1
    np.testing.assert_array_equal(
        np.asarray(p["codes"]), [0x00, 0x80, 0x01, 0x40, 0x40, 0x7E, 0xFE, 0x7F]
    )
    y = np.asarray(decode(p))
    np.testing.assert_array_equal(y[:7], [2.0, -2.0, 1.0, 0.0, 0.0, np.inf, -np.inf])
    assert np.isnan(y[7]) and not np.signbit(y[4])


@pytest.mark.parametrize(
    "dtype, big, cap", [("float16", 60000.0, 2.0**15), ("float32", 3e38, 2.0**127)]
)
def test_natural_never_overflows_the_dtype(dtype, big, cap):
    """Rounding up stops at the dtype's largest power of two (documented)."""
    x = jnp.asarray([big, -big, 1.0, 0.5], dtype)
    for codec in (
        jc.codecs.Natural(stochastic=False, bucket_size=8),
        jc.codecs.Natural(bucket_size=8),
    ):
        for s in range(20):
            y = np.asarray(decode(encode(x, jax.random.key(s), codec)), np.float64)
            assert y[0] == cap and y[1] == -cap and np.all(np.isfinite(y))


@pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
@pytest.mark.parametrize(
    "stochastic, dtype, bucket",
    [
        (stochastic, dtype, (8, 64, 512)[(i + j) % 3])
        for i, stochastic in enumerate((True, False))
        for j, dtype in enumerate(("float32", "bfloat16", "float16"))
    ],
)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_natural_backends_agree_across_the_whole_range(stochastic, dtype, bucket):
    """Values spread over every binade, so most buckets take the underflow
    path of the kernel (more than 63 binades below their top), bit-exact
    against the twin."""
    rng = np.random.default_rng(4)
    n = 20000
    x = np.sign(rng.standard_normal(n)) * np.exp2(rng.uniform(-150, 128, n))
    x = x.astype(np.float32)
    x[::97] = natural_specials()[np.arange(x[::97].size) % natural_specials().size]
    x = jnp.asarray(x.astype(jnp.dtype(dtype)))
    codec = jc.codecs.Natural(stochastic=stochastic, bucket_size=bucket)
    key = jax.random.key(bucket)
    p = encode(x, key, codec, "ffi")
    q = encode(x, key, codec, "xla")
    for k in p.arrays:
        np.testing.assert_array_equal(np.asarray(p[k]), np.asarray(q[k]), err_msg=k)
    a = np.asarray(decode(p, "ffi")).view(np.uint8)
    b = np.asarray(decode(p, "xla")).view(np.uint8)
    np.testing.assert_array_equal(a, b)
