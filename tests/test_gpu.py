"""The CUDA kernels and the twins compiled for the GPU against the CPU kernels, byte for byte.

For each codec, dtype and size, the payload is encoded three ways (CUDA
kernel, twin on the GPU, CPU kernel) and the GPU payloads must equal the CPU
kernel's, array by array; the CPU kernel's payload is then decoded the three
ways and the outputs must be equal too (docs/codecs.md, "One answer"). The golden vectors hold on the GPU, special values included, and
the collectives and a train step run on a one-GPU mesh. The module skips
where JAX sees no CUDA GPU or jaxcomp was built without its CUDA module
(``JAXCOMP_CUDA=ON pip install .``); its case lists are in gpu_cases.py.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_cases import (
    CODECS,
    DTYPES,
    EMPTY_INPUT,
    GRID_STRIDE,
    LARGEST_BUCKET,
    SIZES,
    codec_id,
    decode_sum_codecs,
    dtype_id,
    feedback_codecs,
    first_examples,
    gpu_input,
)
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import wire
from jaxcomp.codecs import FP8, QSGD, Codec, Int8, OneBit, Rate, ThreeLC, TopK


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


@functools.cache
def _encoder(codec: Codec, backend: str):
    return jax.jit(lambda x, key: codec.encode(x, key, backend=backend))


@functools.cache
def _decoder(codec: Codec, backend: str):
    return jax.jit(lambda payload: codec.decode(payload, backend=backend))


def _difference(got, want) -> dict | None:
    """None where ``got`` and ``want`` have the same dtype, shape and bytes;
    else how many elements differ, the first few, and for float arrays the
    largest distance in ulps (in levels for integer codes)."""
    got, want = np.asarray(got), np.asarray(want)
    if (got.dtype, got.shape) != (want.dtype, want.shape):
        return {"mismatch": f"{got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"}
    g, w = got.reshape(-1), want.reshape(-1)
    diff = (g.view(np.uint8) != w.view(np.uint8)).reshape(g.size, g.dtype.itemsize)
    if not diff.any():
        return None
    bad = np.flatnonzero(diff.any(axis=1))
    if jnp.issubdtype(g.dtype, jnp.floating):
        u = np.dtype(f"i{g.dtype.itemsize}")
        gi, wi = g[bad].view(u).astype(np.int64), w[bad].view(u).astype(np.int64)
        both_nan = np.isnan(g[bad]) & np.isnan(w[bad])
        dist = np.where(both_nan, 0, np.abs(gi - wi))
    else:
        dist = np.abs(g[bad].astype(np.int64) - w[bad].astype(np.int64))
    return {
        "count": int(bad.size),
        "of": int(g.size),
        "max_distance": int(dist.max()),
        "first": [[int(i), repr(g[i]), repr(w[i])] for i in bad[:4]],
    }


def _same_but_nan_bits(got, want) -> dict | None:
    """As _difference, with a NaN against a NaN equal whatever their bits:
    for a payload's scales and means, whose NaN bits follow the platform
    where arithmetic made them (x86 0xffc00000, NVIDIA GPUs 0x7fffffff;
    docs/codecs.md, "One answer"). Decoded values have one NaN."""
    got, want = np.asarray(got), np.asarray(want)
    if jnp.issubdtype(got.dtype, jnp.floating) and got.shape == want.shape:
        both = np.isnan(got) & np.isnan(want)
        got, want = (
            np.where(both, 0, got).astype(got.dtype),
            np.where(both, 0, want).astype(got.dtype),
        )
    return _difference(got, want)


def _report(differences: dict[str, dict]) -> None:
    """Fails with every difference found (and, where JAXCOMP_GPU_DIFFS names a
    folder, appends them there as JSON lines for the GPU run's logs)."""
    if not differences:
        return
    folder = os.environ.get("JAXCOMP_GPU_DIFFS")
    if folder:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
            for what, d in differences.items():
                f.write(json.dumps({"test": test, "what": what, **d}) + "\n")
    pytest.fail(
        "; ".join(
            f"{what}: {d['count']} of {d['of']} differ (max {d['max_distance']}), "
            f"first {d['first'][0]}"
            if "count" in d
            else f"{what}: {d['mismatch']}"
            for what, d in differences.items()
        )
    )


def _assert_same(got, want, what: str) -> None:
    d = _difference(got, want)
    _report({what: d} if d else {})


def _on(device: jax.Device, *arrays):
    return [jax.device_put(a, device) for a in arrays]


RUNS = {"gpu-ffi": (GPU, "ffi"), "gpu-xla": (GPU, "xla"), "cpu-ffi": (CPU, "ffi")}


def _check_encodes(codec: Codec, x: np.ndarray, key, decode: bool = False) -> None:
    """The payloads of the CUDA kernel and the twin on the GPU against the
    CPU kernel's (and, with ``decode``, the CPU kernel's payload decoded the
    three ways)."""
    payloads = {
        name: _encoder(codec, backend)(*_on(dev, x, key)) for name, (dev, backend) in RUNS.items()
    }
    ref = payloads["cpu-ffi"]
    differences = {
        f"{name} encode [{k}]": d
        for name in ("gpu-ffi", "gpu-xla")
        for k in ref.arrays
        if (d := _difference(payloads[name][k], ref[k]))
    }
    if decode:
        outs = {
            name: _decoder(codec, backend)(jax.device_put(ref, dev))
            for name, (dev, backend) in RUNS.items()
        }
        differences |= {
            f"{name} decode": d
            for name in ("gpu-ffi", "gpu-xla")
            if (d := _difference(outs[name], outs["cpu-ffi"]))
        }
    _report(differences)


def _check_codec(codec: Codec, dtype, n: int) -> None:
    """Encodes on (GPU, ffi), (GPU, xla) and (CPU, ffi) and compares the GPU
    payloads with the CPU kernel's; then decodes the CPU kernel's payload
    the three ways and compares the outputs. Every difference is reported."""
    x = gpu_input(n, dtype)
    key = jax.random.key(n)
    payloads = {
        name: _encoder(codec, backend)(*_on(dev, x, key)) for name, (dev, backend) in RUNS.items()
    }
    ref = payloads["cpu-ffi"]
    differences = {}
    for name in ("gpu-ffi", "gpu-xla"):
        assert payloads[name].arrays.keys() == ref.arrays.keys()
        for k in ref.arrays:
            if d := _difference(payloads[name][k], ref[k]):
                differences[f"{name} encode [{k}]"] = d
    for k, a in payloads["gpu-ffi"].arrays.items():
        assert a.devices() == {GPU}, f"payload[{k!r}] left the GPU"

    outs = {
        name: _decoder(codec, backend)(jax.device_put(ref, dev))
        for name, (dev, backend) in RUNS.items()
    }
    for name in ("gpu-ffi", "gpu-xla"):
        if d := _difference(outs[name], outs["cpu-ffi"]):
            differences[f"{name} decode"] = d
    assert outs["gpu-ffi"].shape == x.shape
    assert outs["gpu-ffi"].dtype == jnp.dtype(dtype)
    _report(differences)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
def test_kernels_match_twin_and_cpu(codec, dtype, n):
    _check_codec(codec, dtype, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", LARGEST_BUCKET, ids=codec_id)
def test_largest_bucket(codec, dtype):
    _check_codec(codec, dtype, 3 * 65536 + 4099)


@pytest.mark.slow
@pytest.mark.parametrize("codec", GRID_STRIDE, ids=codec_id)
def test_grid_stride(codec):
    _check_codec(codec, "float32", (1 << 24) + 8 * 1000 + 3)


@pytest.mark.parametrize("codec", EMPTY_INPUT, ids=codec_id)
def test_emptygpu_input(codec):
    x, key = _on(GPU, np.zeros((0,), np.float32), jax.random.key(0))
    payload = _encoder(codec, "ffi")(x, key)
    for k, a in payload.arrays.items():
        assert a.size == 0, k
    out = _decoder(codec, "ffi")(payload)
    assert out.shape == (0,) and out.dtype == jnp.float32


def test_ffi_backend_runs_the_cuda_kernels():
    """backend="ffi" on the GPU compiles to the custom calls, not to the twins."""
    codec = QSGD(bits=4, bucket_size=512)
    x, key = _on(GPU, gpu_input(4099, np.float32), jax.random.key(0))
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
        _check_encodes(codec, x, jax.random.key(0), decode=True)


def test_threelc_corrupted_stream_is_nan_on_gpu():
    codec = ThreeLC()
    x = gpu_input(3001, np.float32)
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
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "codec",
    [TopK(fraction=0.05), TopK(fraction=0.3), TopK(k_per_bucket=(700, 65536))],
    ids=codec_id,
)
def test_topk_ties_across_tiles(codec, dtype):
    n = 3 * 65536 + 4099
    rng = np.random.default_rng(5)
    x = np.where(rng.random(n) < 0.1, -2.0, 1.0).astype(dtype)
    _check_encodes(codec, x, jax.random.key(0))


# Batched calls: under jax.vmap each kernel runs as one custom call over
# [batch, item] buffers, which the CUDA handlers launch entry by entry; each
# entry must get the bytes of an unbatched call.
@pytest.mark.parametrize(
    "codec",
    first_examples(),
    ids=codec_id,
)
def test_vmap_matches_per_example(codec):
    xs = np.stack([gpu_input(4099, np.float32, seed=s) for s in range(3)])
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


# Decode-and-accumulate (Codec.decode_sum): on the GPU (the CUDA kernel where
# the codec has one, the twin otherwise) the sum of the rows equals the CPU
# kernel's, bit for bit.
@pytest.mark.parametrize(
    "codec",
    decode_sum_codecs(),
    ids=codec_id,
)
@pytest.mark.parametrize("rows", [1, 4])
def test_decode_sum_matches_twin_and_cpu(codec, rows):
    xs = np.stack([gpu_input(70001, np.float32, seed=s) for s in range(rows)])
    keys = jax.random.split(jax.random.key(1), rows)
    payloads = jax.jit(jax.vmap(lambda x, k: codec.encode(x, k, backend="xla")))(xs, keys)
    outs = {
        name: jax.jit(lambda p, b=backend: codec.decode_sum(p, backend=b))(
            jax.device_put(payloads, dev)
        )
        for name, (dev, backend) in RUNS.items()
    }
    _report(
        {
            f"{name} decode_sum": d
            for name in ("gpu-ffi", "gpu-xla")
            if (d := _difference(outs[name], outs["cpu-ffi"]))
        }
    )


@pytest.mark.parametrize("codec", feedback_codecs(), ids=codec_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_feedback_on_gpu_matches_the_cpu_fused_kernel(codec, dtype):
    """encode_feedback on the GPU gives the CPU fused kernel's payload and
    new residual: "gpu-ffi" is the CUDA one-pass kernel where the codec has
    one (``cuda_feedback_kernel``: every codec with a CPU one but 3LC, TopK
    and the casts), the twins' three calls,
    which XLA fuses, otherwise and for "gpu-xla"."""
    x = gpu_input(70001, dtype, seed=3)
    res = gpu_input(70001, np.float32, seed=4) * np.float32(0.1)
    key = jax.random.key(5)
    outs = {
        name: jax.jit(lambda x, r, k, b=backend: codec.encode_feedback(x, r, k, backend=b))(
            *_on(dev, x, res, key)
        )
        for name, (dev, backend) in RUNS.items()
    }
    ref_payload, ref_res = outs["cpu-ffi"]
    differences = {}
    for name in ("gpu-ffi", "gpu-xla"):
        payload, new_res = outs[name]
        for k in ref_payload.arrays:
            if d := _difference(payload[k], ref_payload[k]):
                differences[f"{name} payload [{k}]"] = d
        if d := _difference(new_res, ref_res):
            differences[f"{name} new residual"] = d
    _report(differences)


# ---------------------------------------------------------------------------
# The golden vectors on the GPU: the bytes are the bytes. Encoded by the CUDA
# kernels and by the twin on the GPU (a payload's NaNs compare as NaN:
# _same_but_nan_bits), and the pinned payloads decoded there.
# ---------------------------------------------------------------------------
_GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "vectors.json").read_text())[
    "cases"
]


@pytest.mark.parametrize("backend", ["ffi", "xla"])
@pytest.mark.parametrize("case", _GOLDEN, ids=[c["id"] for c in _GOLDEN])
def test_golden_vectors_on_gpu(case, backend):
    from test_golden import _codec, _input, _key

    codec = _codec(case)
    x = jax.device_put(_input(case), GPU)
    key = _key(case)
    key = None if key is None else jax.device_put(key, GPU)
    payload = jax.jit(lambda x, k: codec.encode(x, k, backend=backend))(x, key)
    golden = wire.from_bytes(bytes.fromhex(case["wire"]))
    differences = {
        f"encode [{k}]": d
        for k in golden.arrays
        if (d := _same_but_nan_bits(payload[k], golden[k]))
    }
    out = jax.jit(lambda p: codec.decode(p, backend=backend))(jax.device_put(golden, GPU))
    want = np.frombuffer(bytes.fromhex(case["decoded"]), np.asarray(out).dtype)
    if d := _difference(np.asarray(out).reshape(-1), want):
        differences["decode"] = d
    _report(differences)


# ---------------------------------------------------------------------------
# The collectives and the train step on a one-GPU mesh (a real case: one
# GPU per host, or a single GPU): the same bytes as on a one-CPU mesh.
# ---------------------------------------------------------------------------
def _one_device_mesh(device):
    return jax.sharding.Mesh(np.array([device]), ("data",))


@pytest.mark.parametrize("algorithm", ["auto", "allgather", "two_phase", "ring"])
@pytest.mark.parametrize(
    "codec", [QSGD(bits=4), OneBit(), Int8(), ThreeLC(), TopK(fraction=0.01)], ids=codec_id
)
def test_collectives_on_one_gpu_match_one_cpu(codec, algorithm):
    if algorithm in ("two_phase", "ring") and codec.rate is not Rate.FIXED:
        pytest.skip("fixed-rate codecs only")
    x = gpu_input(70001, np.float32)

    def run(device):
        mesh = _one_device_mesh(device)

        def body(x, key):
            r = jaxcomp.pmean(x, "data", codec, key=key, algorithm=algorithm)
            return r.value, r.sent

        f = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False
            )
        )
        return [np.asarray(a) for a in f(*_on(device, x, jax.random.key(3)))]

    gpu, cpu = run(GPU), run(CPU)
    _report(
        {
            what: d
            for what, g, c in zip(("value", "sent"), gpu, cpu, strict=True)
            if (d := _difference(g, c))
        }
    )


def _train_on_one_device_like_cpu(make_step) -> None:
    """Twenty steps of ``make_step(mesh)`` (a jc.data_parallel step) on a
    one-GPU mesh and on a one-CPU mesh, from the same MLP and batch: the
    GPU's loss falls and follows the CPU's (matrix products at float32
    precision on both; the two platforms' matrix products round
    differently, which can move a stochastic rounding by a level, so the
    comparison has a tolerance of a few levels' updates)."""

    def loss_fn(params, batch):
        x, y = batch
        h = jnp.tanh(x @ params["w1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (64, 512)) / 8,
        "w2": jax.random.normal(k2, (512, 1)) / 16,
    }
    x = jax.random.normal(k3, (256, 64))
    batch = (x, jnp.sin(x[:, :1]))

    def run(device):
        step = make_step(loss_fn, _one_device_mesh(device))
        p, s = step.init(jax.device_put(params, device))
        losses = []
        with jax.default_matmul_precision("float32"):
            for _ in range(20):
                p, s, loss = step(p, s, jax.device_put(batch, device))
                losses.append(float(loss))
        return p, losses

    (p_gpu, l_gpu), (p_cpu, l_cpu) = run(GPU), run(CPU)
    assert l_gpu[-1] < 0.5 * l_gpu[0], l_gpu
    np.testing.assert_allclose(l_gpu, l_cpu, rtol=2e-2)
    for k in params:
        assert p_gpu[k].devices() == {GPU}
        np.testing.assert_allclose(np.asarray(p_gpu[k]), np.asarray(p_cpu[k]), rtol=0, atol=1e-2)


def test_train_step_on_one_gpu():
    """jc.data_parallel with QSGD and error feedback on a one-GPU mesh."""
    import optax

    def make_step(loss_fn, mesh):
        tx = optax.chain(
            jaxcomp.optax.compress_gradients(QSGD(bits=4), "data", min_compress_size=0),
            optax.sgd(0.1),
        )
        return jaxcomp.data_parallel(loss_fn, tx, mesh)

    _train_on_one_device_like_cpu(make_step)


# ---------------------------------------------------------------------------
# Sharded training's collectives and step on a one-GPU mesh: the bytes of a
# one-CPU mesh (the decode-and-sum and one-pass kernels on each platform).
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec", [QSGD(bits=4), Int8(), FP8(), OneBit()], ids=codec_id)
def test_scatter_and_gather_on_one_gpu_match_one_cpu(codec):
    x = gpu_input(4 * 16384, np.float32).reshape(4, -1)
    r = gpu_input(4 * 16384, np.float32) / 8

    def run(device):
        mesh = _one_device_mesh(device)

        def body(x, r, key):
            s = jaxcomp.psum_scatter(x, "data", codec, key=key, tiled=True)
            value, kept = jaxcomp.collectives.psum_scatter_feedback(
                x, r, "data", codec, key=key, tiled=True
            )
            g = jaxcomp.all_gather(x, "data", codec, key=key, tiled=True)
            return s.value, s.sent, value, kept, g

        f = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)
        )
        return [np.asarray(a) for a in f(*_on(device, x, r, jax.random.key(5)))]

    names = ("value", "sent", "feedback value", "kept", "gathered")
    _report(
        {
            what: d
            for what, g, c in zip(names, run(GPU), run(CPU), strict=True)
            if (d := _difference(g, c))
        }
    )


def test_sharded_step_on_one_gpu():
    """jc.data_parallel(shard_params=...) with an Int8 all-gather and a
    QSGD-4 reduce-scatter under error feedback on a one-GPU mesh."""
    import optax

    cfg = jaxcomp.fsdp.ShardParams(axis="data", gradients=QSGD(bits=4), parameters=Int8())
    _train_on_one_device_like_cpu(
        lambda loss_fn, mesh: jaxcomp.data_parallel(loss_fn, optax.sgd(0.1), mesh, shard_params=cfg)
    )
