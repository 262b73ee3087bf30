"""The CUDA kernels against their pure-JAX twins and the CPU kernels, byte for byte.

For each codec, dtype and size, the payload is encoded three ways (CUDA
kernel, jnp twin on the GPU, CPU kernel) and every payload array must be
bit-identical; each is then decoded the same three ways and the outputs must be
bit-identical too. The module skips where JAX sees no CUDA GPU or jaxcomp was
built without its CUDA module (``JAXCOMP_CUDA=ON pip install .``).

The inputs avoid float32 denormals: XLA's CPU runtime flushes them and its GPU
code does not, so the CPU and GPU agree bit for bit only on normal numbers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.codecs import (
    QSGD,
    BucketedCodec,
    Cast,
    Codec,
    Int8,
    Natural,
    OneBit,
    Rate,
    TernGrad,
    ThreeLC,
    TopK,
)


def _cuda_device() -> jax.Device | None:
    try:
        devices = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend in this jaxlib, or no GPU
        return None
    return devices[0] if devices else None


GPU = _cuda_device()
if GPU is None:
    pytest.skip("no CUDA GPU visible to JAX", allow_module_level=True)
if not jaxcomp.cuda_available():
    pytest.skip("jaxcomp was built without its CUDA module", allow_module_level=True)

CPU = jax.devices("cpu")[0]

pytestmark = pytest.mark.gpu

# Bucket sizes cover one lane per bucket (8), several buckets per block
# (16..1024), one per block (2048) and lanes that loop (4096).
CODECS = [
    QSGD(bits=2, bucket_size=128),
    QSGD(bits=3, bucket_size=8, norm="l2"),
    QSGD(bits=4, bucket_size=512),
    QSGD(bits=4, bucket_size=64, norm="l2"),
    QSGD(bits=8, bucket_size=2048, norm="l2"),
    QSGD(bits=8, bucket_size=16),
    QSGD(bits=2, bucket_size=4096, norm="l2"),
    OneBit(),
    OneBit(bucket_size=8),
    OneBit(bucket_size=1024),
    Int8(),
    Int8(bucket_size=32),
    Cast("bfloat16"),
    Cast("float16"),
    TernGrad(),
    TernGrad(bucket_size=8),
    TernGrad(bucket_size=4096),
    Natural(),
    Natural(bucket_size=8),
    Natural(stochastic=False, bucket_size=16),
    Natural(stochastic=False, bucket_size=4096),
    ThreeLC(),
    ThreeLC(sparsity=1.75),
    ThreeLC(sparsity=1.5, capacity=64),
    TopK(fraction=0.01),
    TopK(fraction=1.0),
    TopK(k_per_bucket=(8, 512)),
    TopK(k_per_bucket=(100, 128)),
    TopK(fraction=0.05, value_codec=QSGD(bits=4)),
]
# A codec not listed above is checked with its examples, and a bucketed one
# also with the smallest and a looping bucket: a new codec's CUDA kernels are
# tested here without an edit.
_LISTED = {type(c) for c in CODECS}
_NEW = [
    c
    for cls in jaxcomp.codecs.registered()
    if cls not in _LISTED and cls.rate is not Rate.LINEAR
    for c in cls.examples(coverage=True)
]
CODECS += dict.fromkeys(
    _NEW
    + [
        dataclasses.replace(c, bucket_size=b)
        for c in _NEW
        if isinstance(c, BucketedCodec)
        for b in (8, 4096)
    ]
)
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SIZES = [1, 7, 1000, 4099, 70001]


def _codec_id(codec: Codec) -> str:
    """Short ids for the command line: qsgd-b4-B512-max, onebit-B64, cast-float16."""
    if isinstance(codec, QSGD):
        return f"qsgd-b{codec.bits}-B{codec.bucket_size}-{codec.norm}"
    if isinstance(codec, Cast):
        return f"cast-{codec.dtype}"
    if isinstance(codec, Natural):
        mode = "stoch" if codec.stochastic else "nearest"
        return f"natural-{mode}-B{codec.bucket_size}"
    if isinstance(codec, ThreeLC):
        return f"threelc-s{codec.sparsity}-cap{codec.capacity}"
    if isinstance(codec, TopK):
        mode = (
            f"f{codec.fraction}"
            if codec.fraction is not None
            else "k{}-B{}".format(*codec.k_per_bucket)
        )
        nested = f"-{_codec_id(codec.value_codec)}" if codec.value_codec is not None else ""
        return f"topk-{mode}{nested}"
    return f"{codec.name}-B{codec.bucket_size}"


def _dtype_id(dtype) -> str:
    return np.dtype(dtype).name


def _input(n: int, dtype, seed: int = 0) -> np.ndarray:
    """Normal values with an all-zero stretch (a zero-scale bucket where
    buckets are small) and some negative zeros."""
    rng = np.random.default_rng(seed * 1_000_003 + n)
    x = 3.0 * rng.standard_normal(n, dtype=np.float32)
    x[:40] = 0.0
    x[5::97] = -0.0
    return x.astype(dtype)


@functools.cache
def _encoder(codec: Codec, backend: str):
    return jax.jit(lambda x, key: codec.encode(x, key, backend=backend))


@functools.cache
def _decoder(codec: Codec, backend: str):
    return jax.jit(lambda payload: codec.decode(payload, backend=backend))


def _assert_same(got, want, what: str) -> None:
    """Same dtype, shape and bytes; on a difference, names the first element."""
    got, want = np.asarray(got), np.asarray(want)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (
        f"{what}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    )
    g, w = got.reshape(-1), want.reshape(-1)
    diff = g.view(np.uint8).reshape(g.size, -1) != w.view(np.uint8).reshape(w.size, -1)
    if diff.any():
        bad = np.flatnonzero(diff.any(axis=1))
        i = int(bad[0])
        pytest.fail(
            f"{what}: {bad.size} of {g.size} elements differ; first at {i}: {g[i]!r} vs {w[i]!r}"
        )


def _on(device: jax.Device, *arrays):
    return [jax.device_put(a, device) for a in arrays]


def _check_codec(codec: Codec, dtype, n: int) -> None:
    """Encodes and decodes on (GPU, ffi), (GPU, xla) and (CPU, ffi); all bytes equal."""
    x = _input(n, dtype)
    key = jax.random.key(n)
    runs = {
        "gpu-ffi": (GPU, "ffi"),
        "gpu-xla": (GPU, "xla"),
        "cpu-ffi": (CPU, "ffi"),
    }
    payloads = {
        name: _encoder(codec, backend)(*_on(dev, x, key)) for name, (dev, backend) in runs.items()
    }

    ref = payloads["gpu-xla"]
    for name in ("gpu-ffi", "cpu-ffi"):
        assert payloads[name].arrays.keys() == ref.arrays.keys()
        for k in ref.arrays:
            _assert_same(payloads[name][k], ref[k], f"{name} encode, payload[{k!r}]")
    for k, a in payloads["gpu-ffi"].arrays.items():
        assert a.devices() == {GPU}, f"payload[{k!r}] left the GPU"

    # Each decoder reads the payload made on its own device (all equal by now).
    outs = {
        name: _decoder(codec, backend)(jax.device_put(payloads[name], dev))
        for name, (dev, backend) in runs.items()
    }
    for name in ("gpu-ffi", "cpu-ffi"):
        _assert_same(outs[name], outs["gpu-xla"], f"{name} decode")
    assert outs["gpu-ffi"].shape == x.shape
    assert outs["gpu-ffi"].dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("codec", CODECS, ids=_codec_id)
def test_kernels_match_twin_and_cpu(codec, dtype, n):
    _check_codec(codec, dtype, n)


# The largest bucket: one bucket per block, each lane reducing 256 values
# before the shared-memory levels.
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize(
    "codec",
    [
        QSGD(bits=4, bucket_size=65536, norm="l2"),
        QSGD(bits=8, bucket_size=65536),
        OneBit(bucket_size=65536),
        Int8(bucket_size=65536),
        TernGrad(bucket_size=65536),
        Natural(bucket_size=65536),
    ],
    ids=_codec_id,
)
def test_largest_bucket(codec, dtype):
    _check_codec(codec, dtype, 3 * 65536 + 4099)


# More groups of 8 than the decode and cast grids have threads (8192 blocks of
# 256), so their grid-stride loops go round more than once.
@pytest.mark.slow
@pytest.mark.parametrize(
    "codec", [QSGD(), OneBit(), Int8(), Cast("bfloat16"), TernGrad(), Natural()], ids=_codec_id
)
def test_grid_stride(codec):
    _check_codec(codec, jnp.float32, (1 << 24) + 8 * 1000 + 3)


@pytest.mark.parametrize(
    "codec",
    [
        QSGD(),
        OneBit(),
        Int8(),
        Cast("float16"),
        TernGrad(),
        Natural(stochastic=False),
        TopK(),
        TopK(k_per_bucket=(8, 512)),
    ],
    ids=_codec_id,
)
def test_empty_input(codec):
    x, key = _on(GPU, np.zeros((0,), np.float32), jax.random.key(0))
    payload = _encoder(codec, "ffi")(x, key)
    for k, a in payload.arrays.items():
        assert a.size == 0, k
    out = _decoder(codec, "ffi")(payload)
    assert out.shape == (0,) and out.dtype == jnp.float32


def test_ffi_backend_runs_the_cuda_kernels():
    """backend="ffi" on the GPU compiles to the custom calls, not to the twins."""
    codec = QSGD(bits=4, bucket_size=512)
    x, key = _on(GPU, _input(4099, np.float32), jax.random.key(0))
    hlo = _encoder(codec, "ffi").lower(x, key).compile().as_text()
    assert 'custom_call_target="jaxcomp_qsgd_encode"' in hlo
    payload = _encoder(codec, "ffi")(x, key)
    hlo = _decoder(codec, "ffi").lower(payload).compile().as_text()
    assert 'custom_call_target="jaxcomp_qsgd_decode"' in hlo


# ThreeLC: zero runs across the 4096-byte blocks of the CUDA scans (runs of
# every length, starting and ending at block edges, one through a whole
# block), an all-zero tensor, and corrupted streams, which the CUDA decoder
# turns into NaN as the twin does (the CPU kernel raises instead).
def _threelc_block_runs(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    m = -(-n // 5)
    x = rng.uniform(0.6, 1.0, n).astype(np.float32) * np.where(rng.random(n) < 0.5, -1, 1)
    zero = np.zeros(m, bool)
    for j, b in enumerate(range(4096, m, 4096)):
        length = [1, 2, 13, 14, 15, 29, 30, 5000][j % 8]
        a = max(0, b + [0, -1, 1, -length][j % 4])
        zero[a : a + length] = True
    idx = np.flatnonzero(zero)
    for j in range(5):
        e = j * m + idx
        x[e[e < n]] = 0.0
    x[0] = 1.0
    return x.astype(np.float32)


@pytest.mark.parametrize("s", [1.0, 1.9])
def test_threelc_runs_across_blocks(s):
    for x in [_threelc_block_runs(5 * 4096 * 9 + 3), np.zeros(5 * 4096 * 3 + 1, np.float32)]:
        codec = ThreeLC(sparsity=s)
        payloads = {
            "gpu-ffi": _encoder(codec, "ffi")(*_on(GPU, x, jax.random.key(0))),
            "gpu-xla": _encoder(codec, "xla")(*_on(GPU, x, jax.random.key(0))),
            "cpu-ffi": _encoder(codec, "ffi")(*_on(CPU, x, jax.random.key(0))),
        }
        for name in ("gpu-ffi", "cpu-ffi"):
            for k in payloads["gpu-xla"].arrays:
                _assert_same(payloads[name][k], payloads["gpu-xla"][k], f"{name} payload[{k!r}]")
        _assert_same(
            _decoder(codec, "ffi")(payloads["gpu-ffi"]),
            _decoder(codec, "xla")(payloads["gpu-xla"]),
            "decode",
        )


def test_threelc_corrupted_stream_is_nan_on_gpu():
    codec = ThreeLC()
    x = _input(3001, np.float32)
    p = _encoder(codec, "ffi")(*_on(GPU, x, jax.random.key(0)))
    used = int(p["length"][0])
    stream = np.asarray(p["stream"])
    bad = [
        {"length": np.int32([stream.size + 1])},
        {"length": np.int32([used - 1])},
        {"overflow": np.uint8([1])},
        {"stream": np.where(np.arange(stream.size) == 0, 255, stream).astype(np.uint8)},
    ]
    for i, arrays in enumerate(bad):
        a = p.arrays
        a.update({k: jax.device_put(v, GPU) for k, v in arrays.items()})
        q = jaxcomp.Payload(codec, p.shape, p.dtype, a)
        got = np.asarray(_decoder(codec, "ffi")(q))
        want = np.asarray(_decoder(codec, "xla")(q))
        assert np.all(np.isnan(want)), i
        _assert_same(got, want, f"corrupted case {i}")


# TopK: ties at the threshold spread over many tiles of the emit kernel, and
# k that falls inside the ones (0.3) or the twos (0.05); buckets of 65536.
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize(
    "codec",
    [TopK(fraction=0.05), TopK(fraction=0.3), TopK(k_per_bucket=(700, 65536))],
    ids=_codec_id,
)
def test_topk_ties_across_tiles(codec, dtype):
    n = 3 * 65536 + 4099
    rng = np.random.default_rng(5)
    x = np.where(rng.random(n) < 0.1, -2.0, 1.0).astype(dtype)
    runs = {"gpu-ffi": (GPU, "ffi"), "gpu-xla": (GPU, "xla"), "cpu-ffi": (CPU, "ffi")}
    key = jax.random.key(0)
    payloads = {name: _encoder(codec, b)(*_on(dev, x, key)) for name, (dev, b) in runs.items()}
    for name in ("gpu-ffi", "cpu-ffi"):
        for k in payloads["gpu-xla"].arrays:
            _assert_same(payloads[name][k], payloads["gpu-xla"][k], f"{name} payload[{k!r}]")


# Batched calls: under jax.vmap each kernel runs as one custom call over
# [batch, item] buffers, which the CUDA handlers launch entry by entry; each
# entry must get the bytes of an unbatched call.
@pytest.mark.parametrize(
    "codec",
    [cls.examples()[0] for cls in jaxcomp.codecs.registered() if cls.rate is not Rate.LINEAR]
    + [TopK(fraction=0.05, value_codec=QSGD(bits=4))],
    ids=_codec_id,
)
def test_vmap_matches_per_example(codec):
    xs = np.stack([_input(4099, np.float32, seed=s) for s in range(3)])
    keys = jax.random.split(jax.random.key(0), 3)
    encode = jax.jit(jax.vmap(lambda x, k: codec.encode(x, k, backend="ffi")))
    decode = jax.jit(jax.vmap(lambda p: codec.decode(p, backend="ffi")))
    payloads = encode(*_on(GPU, xs, keys))
    outs = decode(payloads)
    for i in range(3):
        single = _encoder(codec, "ffi")(*_on(GPU, xs[i], keys[i]))
        for k in single.arrays:
            _assert_same(payloads[k][i], single[k], f"entry {i}, payload[{k!r}]")
        _assert_same(outs[i], _decoder(codec, "ffi")(single), f"entry {i}, decode")


# Decode-and-accumulate (Codec.decode_sum): the CUDA kernel's sum of the rows
# equals the twin's and the CPU kernel's, bit for bit.
@pytest.mark.parametrize(
    "codec",
    [c for cls in jaxcomp.codecs.registered() if cls.decode_sum_kernel for c in cls.examples()],
    ids=_codec_id,
)
@pytest.mark.parametrize("rows", [1, 4])
def test_decode_sum_matches_twin_and_cpu(codec, rows):
    xs = np.stack([_input(70001, np.float32, seed=s) for s in range(rows)])
    keys = jax.random.split(jax.random.key(1), rows)
    payloads = jax.jit(jax.vmap(lambda x, k: codec.encode(x, k, backend="xla")))(xs, keys)
    outs = {
        name: jax.jit(lambda p, b=backend: codec.decode_sum(p, backend=b))(
            jax.device_put(payloads, dev)
        )
        for name, (dev, backend) in {
            "gpu-ffi": (GPU, "ffi"),
            "gpu-xla": (GPU, "xla"),
            "cpu-ffi": (CPU, "ffi"),
        }.items()
    }
    for name in ("gpu-ffi", "cpu-ffi"):
        _assert_same(outs[name], outs["gpu-xla"], f"{name} decode_sum")
