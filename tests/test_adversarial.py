"""Adversarial payloads: every decode kernel on payloads no encoder writes.

Each codec's payload arrays are replaced by hostile contents (all bit
patterns, NaN / negative / infinite / subnormal scales, lengths past the
buffer, overflow flags that disagree with the length, TopK indices out of
range, unsorted or repeated, ...), decoded through the FFI kernel and the
pure-JAX twin, and the two must agree bit for bit (NaN payload bits
included): the documented result of docs/codecs.md ("Malformed payloads").
The one documented exception is the CPU ThreeLC kernel, which raises on a
corrupted stream where the twin decodes it to NaN everywhere.

The slow tier adds every configuration at more sizes. The sanitizer job
(``.ci/sanitize``) runs the fast part and a wire fuzz (mutated messages through ``jc.wire.parse``, the accepted ones decoded
through the kernels in batches, kernel against twin), against a build of the
CPU module with AddressSanitizer and UndefinedBehaviorSanitizer, with
``JAXCOMP_FUZZ_INPUTS`` messages; those tests skip without that variable.
"""

from __future__ import annotations

import functools
import json
import os
import time
import zlib

import jax
import numpy as np
import pytest
from conftest import CONTRACT_CODECS, codec_id
from helpers import gradient_like

import jaxcomp as jc
from jaxcomp import wire
from jaxcomp.codecs.threelc import ThreeLC
from jaxcomp.codecs.topk import TopK

needs_ffi = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
# The fuzz is the sanitizer job's (.ci/sanitize sets JAXCOMP_FUZZ_INPUTS): run
# without the sanitizers, in the slow tier, it could not fail where the job
# passes. Set JAXCOMP_FUZZ_INPUTS (e.g. 20000) to run it by hand.
sanitizer_job = pytest.mark.skipif(
    "JAXCOMP_FUZZ_INPUTS" not in os.environ, reason="run by .ci/sanitize (JAXCOMP_FUZZ_INPUTS)"
)
KEY = jax.random.key(3)


def _size(codec) -> int:
    """Several buckets with a partial last one (64 for whole-tensor codecs)."""
    g = codec.split_granularity() or 64
    return 2 * max(g, 8) + 3


def _as_words(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _generic_cases(arrays: dict[str, np.ndarray], rng) -> dict[str, dict[str, np.ndarray]]:
    """Hostile contents for each array, whatever it means."""
    cases = {}
    for name, a in arrays.items():
        if a.size == 0:
            continue
        words = _as_words(a)
        wt = words.dtype
        top = np.iinfo(wt).max
        cases[f"{name}: random bits"] = {
            name: rng.integers(0, top, a.size, dtype=wt, endpoint=True).view(a.dtype)
        }
        cases[f"{name}: all ones"] = {name: np.full(a.size, top, wt).view(a.dtype)}
        if a.dtype.kind not in "iub":  # float32, and the 16-bit floats (kind "V" for bfloat16)
            specials = {
                "NaN": np.float32(np.nan),
                "-inf": np.float32(-np.inf),
                "+inf": np.float32(np.inf),
                "negative": -np.abs(a.astype(np.float32)) - np.float32(1),
                "subnormal": np.float32(1e-40),
                "huge": np.float32(3e38),
                "signaling NaN": np.uint32(0x7F800001).view(np.float32),
                "NaN with payload": np.uint32(0xFFC12345).view(np.float32),
            }
            with np.errstate(invalid="ignore", over="ignore"):  # huge, NaN -> float16
                for what, v in specials.items():
                    cases[f"{name}: {what}"] = {name: np.broadcast_to(v, a.shape).astype(a.dtype)}
        else:
            cases[f"{name}: max"] = {name: np.full(a.size, np.iinfo(a.dtype).max, a.dtype)}
            cases[f"{name}: min"] = {name: np.full(a.size, np.iinfo(a.dtype).min, a.dtype)}
    return cases


def _threelc_cases(arrays, codec, n) -> dict[str, dict[str, np.ndarray]]:
    cap = arrays["stream"].size
    used = int(arrays["length"][0])
    i32 = np.int32
    return {
        "length past the buffer, flag clear": {"length": i32([cap + 1])},
        "length 2^31 - 1, flag clear": {"length": i32([2**31 - 1])},
        "length 2^31 - 1, flag set": {"length": i32([2**31 - 1]), "overflow": np.uint8([1])},
        "negative length": {"length": i32([-1])},
        "length -2^31, flag set": {"length": i32([-(2**31)]), "overflow": np.uint8([1])},
        "flag set, length fits": {"overflow": np.uint8([1])},
        "flag 2": {"overflow": np.uint8([2])},
        "flag 255": {"overflow": np.uint8([255])},
        "length one short": {"length": i32([max(used - 1, 0)])},
        "length one long": {"length": i32([min(used + 1, cap)])},
        "length 0": {"length": i32([0])},
        "stream of runs of 14": {"stream": np.full(cap, 255, np.uint8), "length": i32([cap])},
        "stream of 121s": {"stream": np.full(cap, 121, np.uint8), "length": i32([cap])},
        "stream of 243s": {"stream": np.full(cap, 243, np.uint8), "length": i32([cap])},
        "stream of literals": {"stream": np.full(cap, 7, np.uint8), "length": i32([cap])},
        "literals past the expansion": {
            "stream": np.full(cap, 7, np.uint8),
            "length": i32([cap]),
            "scale": np.float32([np.nan]),
        },
    }


def _topk_cases(arrays, codec, n) -> dict[str, dict[str, np.ndarray]]:
    idx = arrays["indices"]
    m = idx.size
    top = np.iinfo(idx.dtype).max
    _, bucket = codec.selection(n)
    limit = n if bucket == 0 else bucket
    cases = {
        "indices reversed": {"indices": idx[::-1].copy()},
        "indices all zero (repeated)": {"indices": np.zeros(m, idx.dtype)},
        "indices at the type's max": {"indices": np.full(m, top, idx.dtype)},
        "one index at the range's limit": {
            "indices": np.where(np.arange(m) == m - 1, min(limit, top), idx).astype(idx.dtype)
        },
        "first two swapped": {"indices": idx[np.r_[1, 0, 2:m]] if m >= 2 else idx},
        "last repeated": {"indices": np.r_[idx[:-1], idx[-2:-1]].astype(idx.dtype)}
        if m >= 2
        else {},
    }
    if bucket:
        # Each bucket's list restarting at 0 is fine; a bucket list that
        # continues the previous one's is out of its range.
        cases["bucket-local indices as global ones"] = {
            "indices": np.minimum(np.arange(m) * 2, top).astype(idx.dtype)
        }
    return {k: v for k, v in cases.items() if v}


def adversarial_payloads(codec, n: int, dtype: str, seed: int = 0, encoded=None):
    """``{case: payload}`` of ``codec`` for a tensor of ``n`` elements
    (``encoded``: its encoding of ``gradient_like(n, seed, dtype)``, where
    the caller has it already)."""
    p = encoded or _encode(gradient_like(n, seed=seed, dtype=dtype), KEY, codec)
    arrays = {k: np.asarray(v) for k, v in p.arrays.items()}
    rng = np.random.default_rng(seed)
    cases = _generic_cases(arrays, rng)
    if isinstance(codec, ThreeLC):
        cases.update(_threelc_cases(arrays, codec, n))
    if isinstance(codec, TopK):
        cases.update(_topk_cases(arrays, codec, n))
    out = {}
    for name, change in cases.items():
        new = dict(arrays)
        for k, v in change.items():
            new[k] = np.asarray(v, arrays[k].dtype).reshape(arrays[k].shape)
        out[name] = codec.payload(new, (n,), dtype)
    return out


@functools.partial(jax.jit, static_argnames="codec")
def _encode(x, key, codec):
    return codec.encode(x, key, backend="xla")


@functools.partial(jax.jit, static_argnames="backend")
def _decode(payload, backend):
    return payload.codec.decode(payload, backend=backend)


@functools.partial(jax.jit, static_argnames="codec")
def _encode_all(xs, key, codec):
    """Several tensors through one program (one compilation)."""
    return [codec.encode(x, key, backend="xla") for x in xs]


@jax.jit
def _decode_stacks(stacks):
    """Kernel and twin over stacks of payloads (one per stack, vmapped)."""

    def both(p):
        return p.codec.decode(p, backend="ffi"), p.codec.decode(p, backend="xla")

    return [jax.vmap(both)(s) for s in stacks]


def check_all_match(groups: list[dict], what: str) -> None:
    """``check_kernel_matches_twin`` on every payload of ``groups`` (lists of
    ``{case: payload}`` of one codec, shape and dtype each), decoded in one
    program; where the kernel raises (CPU ThreeLC on a corrupted stream),
    payload by payload."""
    stacks = []
    for g in groups:
        p0 = next(iter(g.values()))
        arrays = {k: np.stack([np.asarray(p.arrays[k]) for p in g.values()]) for k in p0.arrays}
        stacks.append(jc.Payload(p0.codec, p0.shape, p0.dtype, arrays))
    try:
        out = [(np.asarray(a), np.asarray(b)) for a, b in _decode_stacks(stacks)]
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        assert isinstance(stacks[0].codec, ThreeLC), f"{what}: {e}"
        for g in groups:
            for case, p in g.items():
                check_kernel_matches_twin(p, f"{what} {p.shape} {p.dtype}: {case}")
        return
    for g, (got, twin) in zip(groups, out, strict=True):
        for i, (case, p) in enumerate(g.items()):
            a, b = _as_words(got[i].reshape(-1)), _as_words(twin[i].reshape(-1))
            bad = np.flatnonzero(a != b)
            assert bad.size == 0, (
                f"{what} {p.shape} {p.dtype}: {case}: {bad.size} of {a.size} elements differ, "
                f"first at {bad[:4]}: kernel {[hex(v) for v in a[bad[:4]]]} "
                f"vs twin {[hex(v) for v in b[bad[:4]]]}"
            )


@jax.jit
def _decode_both(payload):
    """Kernel and twin in one program: one compilation per payload type."""
    codec = payload.codec
    return codec.decode(payload, backend="ffi"), codec.decode(payload, backend="xla")


def check_kernel_matches_twin(payload, what: str) -> None:
    """Kernel == twin bit for bit, or (CPU ThreeLC only) the kernel raises
    on a corrupted stream and the twin gives NaN everywhere."""
    try:
        got, twin = (np.asarray(a) for a in _decode_both(payload))
    except (jax.errors.JaxRuntimeError, ValueError) as e:  # as the call path reports it
        assert isinstance(payload.codec, ThreeLC), f"{what}: {e}"
        twin = np.asarray(_decode(payload, "xla"))
        assert "jaxcomp_threelc_decode: corrupted stream" in str(e), f"{what}: {e}"
        assert np.all(np.isnan(twin.astype(np.float32))), f"{what}: the twin is not all NaN"
        return
    a, b = _as_words(got.reshape(-1)), _as_words(twin.reshape(-1))
    bad = np.flatnonzero(a != b)
    assert bad.size == 0, (
        f"{what}: {bad.size} of {a.size} elements differ, first at {bad[:4]}: "
        f"kernel {[hex(v) for v in a[bad[:4]]]} vs twin {[hex(v) for v in b[bad[:4]]]}"
    )


def _fast_codecs():
    """Per codec class, the configurations whose decode differs in a field
    that steers memory: the first example, plus TopK's bucket-local mode and
    ThreeLC with a capacity below ceil(n/5). The slow tier takes them all."""
    out = []
    for cls in jc.codecs.registered():
        ex = cls.examples(coverage=True)
        out.append(ex[0])
        out += [
            c for c in ex[1:] if isinstance(c, TopK) and c.k_per_bucket and c.k_per_bucket[0] < 8
        ]
        out += [c for c in ex[1:] if isinstance(c, ThreeLC) and c.capacity is not None]
    return out


@needs_ffi
@pytest.mark.parametrize("codec", _fast_codecs(), ids=codec_id)
def test_adversarial_payloads(codec):
    dtype = ("float32", "bfloat16", "float16")[codec.codec_id % 3]
    n = _size(codec)
    for case, payload in adversarial_payloads(codec, n, dtype).items():
        check_kernel_matches_twin(payload, f"{codec!r} n={n} {dtype}: {case}")


@needs_ffi
@pytest.mark.slow
@pytest.mark.parametrize("codec", CONTRACT_CODECS, ids=codec_id)
def test_adversarial_payloads_sizes_and_dtypes(codec):
    """Every configuration; a single element, and a size over several
    buckets of the largest bucket size. Both sizes encode in one program
    and all their cases decode in one (kernel and twin, vmapped)."""
    sizes = ((1, "bfloat16"), (4099, "float16"))
    xs = [gradient_like(n, seed=n, dtype=dtype) for n, dtype in sizes]
    encoded = _encode_all(xs, KEY, codec)
    groups = [
        adversarial_payloads(codec, n, dtype, seed=n, encoded=p)
        for (n, dtype), p in zip(sizes, encoded, strict=True)
    ]
    check_all_match(groups, repr(codec))


def test_topk_malformed_indices_decode_to_nan():
    """The documented rule itself (twin; the kernel is held to it above)."""
    codec = TopK(k_per_bucket=(3, 8))
    p = codec.encode(gradient_like(20, seed=1), backend="xla")
    good = np.asarray(_decode(p, "xla"))
    assert not np.any(np.isnan(good))
    idx = np.asarray(p["indices"])
    for bad in (idx[::-1], np.zeros_like(idx), np.full_like(idx, 8)):
        q = codec.payload({"indices": bad.copy(), "values": p["values"]}, p.shape, p.dtype)
        assert np.all(np.isnan(np.asarray(_decode(q, "xla"))))
    # The last bucket (4 values) lists its 4 elements then no padding (k=3):
    # its indices 0..2 are in range; local index 3..7 in range too (padding
    # past n is dropped, not malformed).
    idx2 = idx.copy()
    idx2[-1] = 7
    q = codec.payload({"indices": idx2, "values": p["values"]}, p.shape, p.dtype)
    assert not np.any(np.isnan(np.asarray(_decode(q, "xla"))))


# ---------------------------------------------------------------------------
# Wire fuzz
# ---------------------------------------------------------------------------
FUZZ_BATCH = 256
# What a reader of untrusted messages would allow: a mutated header can
# declare up to 2^32 - 1 elements in a message of a few bytes (ThreeLC with a
# fixed capacity, TopK), which would then decode into gigabytes.
FUZZ_MAX_ELEMENTS = 1 << 16


def _seed_messages(shard: int = 0, shards: int = 1) -> list[bytes]:
    """One valid message per codec configuration (shapes and dtypes taken
    in turn): each (configuration, shape, dtype) costs two compilations."""
    out = []
    shapes = [(1,), (37,), (3, 50), (2, 1, 70)]
    for i, codec in list(enumerate(CONTRACT_CODECS))[shard::shards]:
        shape, dtype = shapes[i % len(shapes)], ("float32", "bfloat16", "float16")[i % 3]
        x = gradient_like(int(np.prod(shape)), seed=i, dtype=dtype).reshape(shape)
        out.append(wire.to_bytes(_encode(x, KEY, codec)))
    return out


def _header_len(msg: bytes) -> int:
    ndim, nparams, narrays = msg[9], msg[10], msg[11]
    return 20 + 8 * nparams + 8 * ndim + 9 * narrays


def _mutants(seed_msg: bytes, count: int, rng) -> list[bytes]:
    """``count`` mutations of one message: data bytes changed (CRC fixed, so
    the reader accepts them and the decoders see them), header bytes changed
    (CRC fixed or not), a data region overwritten with one byte value,
    truncations and extensions."""
    base = np.frombuffer(seed_msg, np.uint8)
    L, H = base.size, _header_len(seed_msg)
    D = L - 4 - H  # data bytes
    rows = np.tile(base, (count, 1))
    kind = rng.integers(0, 8, count)  # 0-3: data bytes; 4-5: header; 6: region; 7: length
    r = np.arange(count)[:, None]
    if D > 0:
        # Up to 8 data bytes per row (the rows that draw fewer repeat one).
        nmut = rng.integers(1, 9, (count, 1))
        pos = H + rng.integers(0, D, (count, 8))
        pos = np.where(np.arange(8) < nmut, pos, pos[:, :1])
        sel = kind < 4
        rows[r[sel], pos[sel]] = rng.integers(0, 256, (int(sel.sum()), 8), dtype=np.uint8)
        # A region of the data set to a value that means something somewhere.
        a = H + rng.integers(0, D, count)
        b = a + 1 + (rng.random(count) * (H + D - a)).astype(np.int64)
        fill = rng.choice(np.array([0, 255, 121, 243, 0x7F, 0x80], np.uint8), count)
        cols = np.arange(L)
        region = (kind == 6)[:, None] & (cols >= a[:, None]) & (cols < b[:, None])
        rows = np.where(region, fill[:, None], rows)
    sel = (kind == 4) | (kind == 5) | ((kind < 4) & (D <= 0))
    hpos = rng.integers(0, H, (count, 2))
    rows[r[sel], hpos[sel]] = rng.integers(0, 256, (int(sel.sum()), 2), dtype=np.uint8)
    keep_crc = sel & (rng.random(count) < 0.3)  # CRC left as it was
    cuts = rng.integers(0, L + 16, count)
    tail = rng.bytes(16)
    out = []
    for i in range(count):
        if kind[i] == 7:
            out.append((seed_msg + tail)[: cuts[i]])
            continue
        body = rows[i, : L - 4].tobytes()
        crc = rows[i, L - 4 :].tobytes() if keep_crc[i] else zlib.crc32(body).to_bytes(4, "little")
        out.append(body + crc)
    return out


class _Decoder:
    """Decodes stacked payloads of one (codec, shape, dtype) in fixed-size
    batches through the kernel and the twin (vmap: one kernel call per
    batch), and compares them."""

    def __init__(self):
        self.fns = {}
        self.pending: dict[tuple, list[dict[str, np.ndarray]]] = {}
        self.decoded = 0
        self.raised = 0

    def add(self, codec, shape, dtype, arrays):
        key = (codec, shape, np.dtype(dtype).name)
        self.pending.setdefault(key, []).append(arrays)
        if len(self.pending[key]) >= FUZZ_BATCH:
            self.flush(key)

    def _fn(self, key, backend):
        if (key, backend) not in self.fns:
            codec = key[0]

            def one(p):
                return codec.decode(p, backend=backend)

            self.fns[key, backend] = jax.jit(jax.vmap(one))
        return self.fns[key, backend]

    def flush(self, key):
        items = self.pending.pop(key, [])
        if not items:
            return
        codec, shape, dtype = key
        real = len(items)
        items = items + [items[-1]] * (FUZZ_BATCH - real)
        stacked = {k: np.stack([it[k] for it in items]) for k in items[0]}
        p = jc.Payload(codec, shape, dtype, stacked)
        twin = np.asarray(self._fn(key, "xla")(p))
        self.decoded += real
        try:
            got = np.asarray(self._fn(key, "ffi")(p))
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            # Every entry of the batch went through the kernel before the
            # call reported the first corrupted one.
            assert isinstance(codec, ThreeLC) and "corrupted stream" in str(e), e
            self.raised += 1
            return
        a = _as_words(got.reshape(FUZZ_BATCH, -1))
        b = _as_words(twin.reshape(FUZZ_BATCH, -1))
        bad = np.flatnonzero(np.any(a != b, axis=1))
        assert bad.size == 0, f"{codec!r} {shape} {dtype}: kernel != twin for a fuzzed payload"

    def flush_all(self):
        for key in list(self.pending):
            self.flush(key)


def run_fuzz(inputs: int, seed: int, shard: int = 0, shards: int = 1) -> dict:
    """Mutates the seed messages (every ``shards``-th, from ``shard``)
    ``inputs`` times in all, parses each with ``jc.wire.parse`` (only
    ``WireFormatError`` may come out) and decodes the accepted ones through
    kernel and twin."""
    rng = np.random.default_rng(seed)
    seeds = _seed_messages(shard, shards)
    dec = _Decoder()
    tried = accepted = 0
    t0 = time.perf_counter()
    per_round = 256
    while tried < inputs:
        msg0 = seeds[int(rng.integers(len(seeds)))]
        for msg in _mutants(msg0, min(per_round, inputs - tried), rng):
            tried += 1
            try:
                codec, shape, dtype, arrays = wire.parse(msg, max_elements=FUZZ_MAX_ELEMENTS)
            except jc.WireFormatError:
                continue
            accepted += 1
            dec.add(codec, shape, dtype, arrays)
    dec.flush_all()
    return {
        "inputs": tried,
        "accepted": accepted,
        "decoded": dec.decoded,
        "batches_that_raised": dec.raised,
        "seconds": round(time.perf_counter() - t0, 1),
    }


@needs_ffi
@sanitizer_job
@pytest.mark.slow
@pytest.mark.parametrize("shard", [0, 1])
def test_wire_fuzz(shard):
    """Two shards (one per xdist worker), each with half of the seed
    messages; ``JAXCOMP_FUZZ_INPUTS`` is the total over both, ``JAXCOMP_FUZZ_REPORT`` a file prefix for each shard's
    figures (JSON)."""
    total = int(os.environ["JAXCOMP_FUZZ_INPUTS"])
    stats = run_fuzz(total // 2 + (total % 2) * (shard == 0), 1000 + shard, shard, 2)
    report = os.environ.get("JAXCOMP_FUZZ_REPORT")
    if report:
        with open(f"{report}.{shard}.json", "w") as f:
            json.dump(stats, f)
    assert stats["accepted"] > 0 and stats["decoded"] == stats["accepted"]
