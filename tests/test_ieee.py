"""jaxcomp.ops.ieee: division and square root rounded as IEEE 754 (and x86)
do, from integer operations, so that the twins give the kernels' bits on
platforms whose XLA code rounds them otherwise (docs/codecs.md, "One
answer"). numpy's float32 operations run on the CPU's SSE unit: the
reference, with the kernels' flush of subnormal operands and results."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxcomp.ops import ieee

TINY = np.float32(np.finfo(np.float32).tiny)


def _ftz(x: np.ndarray) -> np.ndarray:
    x = np.array(x, np.float32, copy=True)
    small = np.abs(x) < TINY
    x[small] = np.copysign(np.float32(0), x[small])
    return x


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _random_floats(n: int, seed: int) -> np.ndarray:
    """Every class of float32: uniform bit patterns (NaNs, infinities,
    subnormals and zeros included)."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64)
    return bits.astype(np.uint32).view(np.float32)


SPECIAL = np.array(
    [0.0, -0.0, 1e-45, -1e-40, TINY, -TINY, 1.0, -1.0, 2.0, 3.0, 7.0, 127.0, 3e38, -3e38, np.inf],
    np.float32,
)
SPECIAL = np.concatenate([SPECIAL, -SPECIAL[-1:], np.float32([np.nan])])
SPECIAL = np.concatenate([SPECIAL, np.array([0xFFC00001, 0x7F800001], np.uint32).view(np.float32)])


def _same(got, want):
    got, want = _bits(got), _bits(want)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (
        f"{bad.size} differ, first at {bad[:3]}: {got[bad[:3]]} vs {want[bad[:3]]}"
    )


# The integer constructions (what the twins run on GPUs) and the functions
# the twins call (XLA's own operations on the CPU), against numpy.
DIV = [ieee.div_exact, ieee.div]
SQRT = [ieee.sqrt_exact, ieee.sqrt]


@pytest.mark.parametrize("div", DIV)
@pytest.mark.parametrize("seed", [0, 1])
def test_division_of_random_bit_patterns(seed, div):
    a, b = _random_floats(1 << 18, seed), _random_floats(1 << 18, seed + 100)
    with np.errstate(all="ignore"):
        _same(jax.jit(div)(a, b), _ftz(_ftz(a) / _ftz(b)))


@pytest.mark.parametrize("div", DIV)
def test_division_as_the_codecs_use_it(div):
    """Constants over scales, sums over counts: quotients near 1, where
    approximate division errs most often."""
    rng = np.random.default_rng(2)
    scale = (rng.uniform(1, 2, 1 << 16) * np.exp2(rng.integers(-30, 30, 1 << 16))).astype(
        np.float32
    )
    for k in (1, 3, 7, 15, 127, 448, 57344):
        _same(div(np.float32(k), scale), np.float32(k) / scale)
    total = rng.standard_normal(1 << 16).astype(np.float32) * 100
    count = rng.integers(1, 65537, 1 << 16).astype(np.float32)
    _same(div(total, count), total / count)


@pytest.mark.parametrize("div", DIV)
def test_division_of_special_values(div):
    a, b = np.meshgrid(SPECIAL, SPECIAL)
    with np.errstate(all="ignore"):
        _same(jax.jit(div)(a.ravel(), b.ravel()), _ftz(_ftz(a.ravel()) / _ftz(b.ravel())))


@pytest.mark.parametrize("sqrt", SQRT)
@pytest.mark.parametrize("seed", [0, 1])
def test_sqrt_of_random_bit_patterns(seed, sqrt):
    x = _random_floats(1 << 18, seed + 7)
    with np.errstate(all="ignore"):
        _same(jax.jit(sqrt)(x), _ftz(np.sqrt(_ftz(x))))


@pytest.mark.parametrize("sqrt", SQRT)
def test_sqrt_of_special_values_and_squares(sqrt):
    with np.errstate(all="ignore"):
        _same(jax.jit(sqrt)(SPECIAL), _ftz(np.sqrt(_ftz(SPECIAL))))
    r = np.arange(1, 5000, dtype=np.float32)
    _same(jax.jit(sqrt)(r * r), r)
