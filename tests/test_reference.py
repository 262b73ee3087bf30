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
    """codecs.h exact_square: v^2 from three exact products (within 2^-23 of v*v)."""
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
