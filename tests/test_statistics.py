"""Statistical properties of the stochastic codecs and of the shared RNG.

Every test uses fixed keys, so it is deterministic; the tolerances are set
from the codec's own variance so that a correct codec fails with a
probability far below 1e-6 for a random key (the margins are noted)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp.ops.rng import rng_bits, rng_uniform

K = 4000  # keys (independent encodings) per test


@functools.partial(jax.jit, static_argnames=("codec",))
def _samples(x, keys, codec):
    return jax.vmap(lambda k: codec.decode(codec.encode(x, k, backend="xla")))(keys)


def _qsgd_levels(x, codec):
    """Per-element step and fractional grid position, as the codec sees them."""
    b = codec.bucket_size
    xb = np.pad(x, (0, -x.size % b)).reshape(-1, b).astype(np.float64)
    scale = np.sqrt((xb * xb).sum(1)) if codec.norm == "l2" else np.abs(xb).max(1)
    s = codec.levels
    r = np.abs(xb) / scale[:, None] * s
    step = np.repeat(scale / s, b)[: x.size]
    frac = (r - np.floor(r)).reshape(-1)[: x.size]
    return step, frac, xb, scale


@pytest.mark.parametrize(
    "codec",
    [
        jc.codecs.QSGD(bits=2, bucket_size=128),
        jc.codecs.QSGD(bits=4, bucket_size=512),
        jc.codecs.QSGD(bits=4, bucket_size=64, norm="l2"),
        jc.codecs.QSGD(bits=8, bucket_size=512),
    ],
    ids=repr,
)
def test_qsgd_is_unbiased_within_its_variance(codec):
    n = 2048
    rng = np.random.default_rng(codec.bits)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)
    keys = jax.random.split(jax.random.key(1234), K)
    q = np.asarray(_samples(jnp.asarray(x), keys, codec), np.float64)
    step, frac, _xb, _scale = _qsgd_levels(x, codec)
    var = step**2 * frac * (1 - frac)  # exact per-element variance of the codec
    mean = q.mean(0)

    # Each sample is one of the two neighbouring levels.
    lo = np.floor(np.abs(x) / step + 1e-6)
    assert np.all(np.abs(np.abs(q) / step - lo) < 1 + 1e-4)

    # Unbiased: z-scores of the mean over K keys. Elements whose Bernoulli is
    # too lopsided for the normal approximation (K p (1-p) < 20) are checked
    # by an absolute bound instead.
    ok = K * frac * (1 - frac) >= 20
    z = (mean[ok] - x[ok]) / np.sqrt(var[ok] / K)
    m = ok.sum()
    assert m > n / 4
    assert abs(z.mean()) < 6 / np.sqrt(m)  # 6 sigma of the mean of m z-scores
    chi2 = float((z**2).sum())
    assert abs(chi2 - m) < 6 * np.sqrt(2 * m), (chi2, m)  # chi^2(m), 6 sigma
    assert np.max(np.abs(z)) < 6.5
    rare = ~ok
    assert np.all(np.abs(mean[rare] - x[rare]) <= step[rare] * 60 / K + 1e-7)

    # Variance: matches p(1-p) step^2 and never exceeds the bound step^2 / 4.
    emp = q.var(0)
    assert np.all(emp <= step**2 / 4 * 1.2 + 1e-12)
    assert abs(emp.sum() / var.sum() - 1) < 0.05


def test_qsgd_l2_variance_bound_of_the_paper():
    """E||Q(v) - v||^2 <= min(n/s^2, sqrt(n)/s) ||v||^2 per bucket (QSGD, Lemma 3.1)."""
    codec = jc.codecs.QSGD(bits=2, bucket_size=256, norm="l2")
    n = 1024
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    keys = jax.random.split(jax.random.key(7), 1000)
    q = np.asarray(_samples(jnp.asarray(x), keys, codec), np.float64)
    b, s = codec.bucket_size, codec.levels
    err = ((q - x) ** 2).reshape(len(keys), -1, b).sum(-1).mean(0)
    norm2 = (x.astype(np.float64).reshape(-1, b) ** 2).sum(-1)
    bound = min(b / s**2, np.sqrt(b) / s) * norm2
    assert np.all(err <= bound)


def test_keys_give_independent_encodings():
    codec = jc.codecs.QSGD(bits=2, bucket_size=512)
    # Every value but each bucket's max (1.0) rounds to 0 or 1 with p = 1/2.
    x = jnp.full((4096,), 0.5, jnp.float32).at[::512].set(1.0)
    keys = jax.random.split(jax.random.key(3), 64)
    coins = (
        np.asarray(_samples(x, keys, codec)).reshape(64, -1, 512)[:, :, 1:].reshape(64, -1) > 0.75
    )
    m = coins.shape[1]
    assert abs(coins.mean() - 0.5) < 6 * 0.5 / np.sqrt(coins.size)
    # Pairwise agreement between keys: 0.5 +- 6 sigma for m fair coins.
    agree = (coins[:, None, :] == coins[None, :, :]).mean(-1)[np.triu_indices(64, 1)]
    assert np.all(np.abs(agree - 0.5) < 6 * 0.5 / np.sqrt(m))


def test_rng_is_uniform_and_decorrelated():
    seed = jnp.asarray([0x12345678, 0x9ABCDEF0], jnp.uint32)
    idx = jnp.arange(1 << 20, dtype=jnp.uint32)
    u = np.asarray(rng_uniform(seed, idx), np.float64)
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    expected = u.size / 64
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 63 + 6 * np.sqrt(2 * 63)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 6 / np.sqrt(u.size)
    # Each output bit is a fair coin.
    bits = np.asarray(rng_bits(seed, idx))
    ones = np.array([((bits >> i) & 1).mean() for i in range(32)])
    assert np.all(np.abs(ones - 0.5) < 6 * 0.5 / np.sqrt(bits.size))
    # Neighbouring seeds give unrelated streams, not shifted copies.
    seed2 = seed.at[0].add(1)
    u2 = np.asarray(rng_uniform(seed2, idx), np.float64)
    assert abs(np.corrcoef(u, u2)[0, 1]) < 6 / np.sqrt(u.size)
    assert abs(np.corrcoef(u[1:], u2[:-1])[0, 1]) < 6 / np.sqrt(u.size)
