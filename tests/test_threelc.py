"""3LC (Lim, Andersen, Kaminsky, SysML 2019, sections 3.1-3.3) against a
plain, serial numpy reference written from the paper; the parallel CPU
encoder's partition boundaries; corrupted streams; capacity and overflow."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxcomp as jc
from jaxcomp import wire
from jaxcomp.codecs import ThreeLC
from jaxcomp.payload import Payload

needs_ffi = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
BACKENDS = ["ffi", "xla"] if jc.cpu_available() else ["xla"]
TINY = np.float32(np.finfo(np.float32).tiny)

# ffi/threelc.cc: base-3^5 bytes per zero-run partition (kElementsPerTask / 5).
PART_BYTES = 65536 // 5


# ---------------------------------------------------------------------------
# The reference: sections 3.1-3.3 as the paper writes them, one step at a time.
# ---------------------------------------------------------------------------
def ref_quantize(x, s):
    """(q in {-1, 0, 1} as int64, m as float32) of section 3.1.

    XLA's CPU runtime (and the kernels) flush float32 subnormals to zero, so
    they count as zero here: in the max and in the rounding."""
    x = np.asarray(x, np.float32).reshape(-1).astype(np.float64)
    x = np.where(np.abs(x) < TINY, 0.0, x)
    mx = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
    if np.isnan(x).any():
        mx = np.float32(np.nan)
    m = np.float32(mx * np.float32(s))
    if not np.isfinite(m):
        return np.zeros(x.size, np.int64), m  # decodes to NaN everywhere
    if m == 0:
        return np.zeros(x.size, np.int64), m
    # np.round is round-half-to-even; float64 division of float32 values is
    # exact enough to decide every tie exactly.
    q = np.round(x / np.float64(m)).astype(np.int64)
    assert np.all(np.abs(q) <= 1)
    return q, m


def ref_base3(q):
    """Section 3.2 steps 1-5: q + 1, pad with zeros (q = 0) to a multiple of
    5, five equal planes, P0*81 + P1*27 + P2*9 + P3*3 + P4."""
    d = (np.asarray(q, np.int64) + 1).astype(np.uint8)
    m = -(-d.size // 5)
    d = np.concatenate([d, np.ones(5 * m - d.size, np.uint8)])
    p = d.reshape(5, m).astype(np.int64)
    return (p[0] * 81 + p[1] * 27 + p[2] * 9 + p[3] * 3 + p[4]).astype(np.uint8)


def ref_zre(b):
    """Section 3.3, serially: k consecutive 121s (2 <= k <= 14) -> 243 + (k - 2),
    greedy from the start of each run."""
    out = []
    i, n = 0, len(b)
    while i < n:
        if b[i] != 121:
            out.append(int(b[i]))
            i += 1
            continue
        j = i
        while j < n and b[j] == 121:
            j += 1
        run = j - i
        while run >= 2:
            k = min(run, 14)
            out.append(243 + k - 2)
            run -= k
        if run == 1:
            out.append(121)
        i = j
    return bytes(out)


def ref_encode(x, s):
    q, m = ref_quantize(x, s)
    return ref_zre(ref_base3(q)), m, q


def ref_decoded(x, s, dtype):
    q, m = ref_quantize(x, s)
    with np.errstate(invalid="ignore"):
        return (q.astype(np.float32) * m).astype(dtype)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("codec", "backend"))
def _enc(x, codec, backend):
    return codec.encode(x, backend=backend)


@functools.partial(jax.jit, static_argnames=("backend",))
def _dec(p, backend):
    return p.codec.decode(p, backend=backend)


@functools.partial(jax.jit, static_argnames=("codec", "backend"))
def _round_trip(x, codec, backend):
    """(payload, decoded) of one compiled encode and decode."""
    p = codec.encode(x, backend=backend)
    return p, codec.decode(p, backend=backend)


def stream_bytes(p) -> bytes:
    n = min(int(p["length"][0]), p["stream"].shape[0])
    return np.asarray(p["stream"])[:n].tobytes()


def bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def check_against_reference(x, s, backends=BACKENDS):
    """Both backends: stream, scale, length, zero tail and decode equal the
    reference exactly."""
    x = np.asarray(x)
    codec = ThreeLC(sparsity=s)
    want, m, _ = ref_encode(np.asarray(x, np.float32), s)
    want_y = ref_decoded(np.asarray(x, np.float32), s, x.dtype)
    for backend in backends:
        p, y = _round_trip(jnp.asarray(x), codec, backend)
        assert stream_bytes(p) == want, f"{backend}: stream differs from the reference"
        assert int(p["length"][0]) == len(want)
        assert int(p["overflow"][0]) == 0
        assert np.all(np.asarray(p["stream"])[len(want) :] == 0), "bytes past the length"
        assert bits(p["scale"])[0] == bits(np.float32([m]))[0]
        assert int(p.used_nbytes) == len(want) + 9
        y = np.asarray(y).reshape(-1)
        assert bits(y).tobytes() == bits(want_y).tobytes(), f"{backend}: decode"


def sparse_spikes(rng, n, density, zero_blocks):
    """Mostly tiny values with sparse large spikes, plus blocks of exact zeros:
    long zero runs of every length, broken by isolated non-zero digits."""
    x = rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
    spikes = rng.random(n) < density
    x[spikes] = rng.standard_normal(int(spikes.sum())).astype(np.float32) * 10
    for _ in range(zero_blocks):
        a = int(rng.integers(0, max(n, 1)))
        x[a : a + int(rng.integers(1, 400))] = 0
    return x


SPARSITIES = [1.0, 1.25, 1.5, 1.75, 1.9, 1.99]


# ---------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------
@settings(
    derandomize=True,
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    n=st.one_of(st.integers(0, 40), st.integers(0, 3000)),
    seed=st.integers(0, 2**32 - 1),
    density=st.sampled_from([0.0, 0.0005, 0.003, 0.02, 0.2, 1.0]),
    zero_blocks=st.integers(0, 6),
    s=st.sampled_from(SPARSITIES),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
)
def test_matches_reference(n, seed, density, zero_blocks, s, dtype):
    rng = np.random.default_rng(seed)
    x = sparse_spikes(rng, n, density, zero_blocks)
    check_against_reference(x.astype(dtype), s)


@pytest.mark.parametrize("n, s", [(5 * 65536 * 3 + 3, 1.75), (1 << 20, 1.0)])
def test_matches_reference_large(n, s):
    rng = np.random.default_rng(n)
    check_against_reference(sparse_spikes(rng, n, 0.0002, 200), s)


def test_reference_is_the_papers_figure():
    """The 3.2 example: five zeros are the byte 121; 3.3: a run of 30 is
    14, 14, 2; 15 is 14 and a lone 121."""
    assert ref_base3(np.zeros(5, np.int64)).tolist() == [121]
    assert ref_zre(bytes([121] * 30)) == bytes([255, 255, 243])
    assert ref_zre(bytes([121] * 15)) == bytes([255, 121])
    assert ref_zre(bytes([121, 7, 121, 121, 8])) == bytes([121, 7, 243, 8])


def test_ternary_planes_are_the_papers():
    """The shared base-3^5 packing splits into five equal planes, element
    j*m + i in digit j of byte i, as section 3.2 step 5."""
    from jaxcomp.ops import ternary

    rng = np.random.default_rng(3)
    for n in [1, 4, 5, 6, 99, 1001]:
        d = rng.integers(0, 3, n)
        assert np.array_equal(np.asarray(ternary.pack(jnp.asarray(d))), ref_base3(d - 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rounding_is_half_to_even(backend):
    """round(x / m) with ties to even: |x / m| = 1/2 gives 0, just above gives +-1."""
    above = np.nextafter(np.float32(0.5), np.float32(1))
    x = np.array([1.0, 0.5, -0.5, above, -above, 0.25, -1.0, 0.0, -0.0], np.float32)
    p = _enc(jnp.asarray(x), ThreeLC(), backend)
    y = np.asarray(_dec(p, backend))
    assert y.tolist() == [1.0, 0.0, 0.0, 1.0, -1.0, 0.0, -1.0, 0.0, 0.0]
    # s = 1.5: m = 1.5, tie at 0.75.
    x = np.array([1.0, 0.75, -0.75, np.nextafter(np.float32(0.75), np.float32(1))], np.float32)
    y = np.asarray(_dec(_enc(jnp.asarray(x), ThreeLC(sparsity=1.5), backend), backend))
    assert y.tolist() == [1.5, 0.0, 0.0, 1.5]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_all_zero(backend, dtype):
    n = 14 * 5 * 3 + 5  # 43 bytes of 121: 14, 14, 14, then a lone 121
    p = _enc(jnp.zeros((n,), dtype), ThreeLC(sparsity=1.5), backend)
    assert stream_bytes(p) == bytes([255, 255, 255, 121])
    assert float(p["scale"][0]) == 0.0
    y = np.asarray(_dec(p, backend), np.float32)
    assert np.all(y == 0) and not np.signbit(y).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_input_makes_everything_nan(backend, bad):
    """A NaN or +-inf makes m non-finite; q is then 0 everywhere and m * q is
    NaN for every element (docs/codecs.md)."""
    x = np.linspace(-1, 1, 1001).astype(np.float32)
    x[500] = bad
    p = _enc(jnp.asarray(x), ThreeLC(), backend)
    assert not np.isfinite(float(p["scale"][0]))
    assert stream_bytes(p) == ref_zre(bytes([121] * 201))
    assert np.all(np.isnan(np.asarray(_dec(p, backend))))


# ---------------------------------------------------------------------------
# The parallel encoder: runs across the zero-run partitions' boundaries
# ---------------------------------------------------------------------------
def _num_parts(m):
    return max(1, min(m // PART_BYTES, 4096))


def _boundary_runs(n, seed):
    """Values whose digits are all non-zero (|x| > max/2), except for runs of
    zero bytes of many lengths placed at, just before and just after every
    partition boundary of the parallel zero-run encoder."""
    rng = np.random.default_rng(seed)
    m = -(-n // 5)
    mag = rng.uniform(0.6, 1.0, n).astype(np.float32)
    x = np.where(rng.random(n) < 0.5, -mag, mag).astype(np.float32)
    parts = _num_parts(m)
    assert parts >= 4, "not enough partitions to test"
    zero_bytes = np.zeros(m, bool)
    lengths = [1, 2, 3, 13, 14, 15, 16, 27, 28, 29, 30, 31, 100, 2 * PART_BYTES]
    for p in range(1, parts):
        b = p * m // parts
        length = lengths[p % len(lengths)]
        offset = [0, 1, -1, -length + 1, -length, -length // 2][p % 6]
        a = max(0, b + offset)
        zero_bytes[a : a + length] = True
    # Runs ending exactly at the end of the stream and starting at byte 0.
    zero_bytes[:29] = True
    zero_bytes[m - 31 :] = True
    idx = np.flatnonzero(zero_bytes)
    for j in range(5):
        e = j * m + idx
        x[e[e < n]] = 0.0
    x[0] = 1.0  # max|x| = 1 (byte 0 is then not a zero)
    return x


@needs_ffi
@pytest.mark.parametrize("n", [5 * 65536 * 4 + 3, 5 * 65536 * 9 + 1])
def test_parallel_encoder_coalesces_runs_across_partitions(n):
    x = _boundary_runs(n, seed=n)
    check_against_reference(x, 1.0)


@needs_ffi
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parallel_encoder_one_run_through_every_partition(dtype):
    n = 5 * 65536 * 6 + 2
    x = np.zeros(n, np.float32)
    x[-1] = 1.0  # the last byte is not a zero: one run over all the others
    check_against_reference(x.astype(dtype), 1.9)


# ---------------------------------------------------------------------------
# Corrupted streams: the FFI decoder raises, the twin gives NaN everywhere
# ---------------------------------------------------------------------------
N_CORRUPT = 3001


def _valid_payload():
    rng = np.random.default_rng(11)
    x = sparse_spikes(rng, N_CORRUPT, 0.004, 3)
    return ThreeLC().encode(jnp.asarray(x), backend="xla")


def _with(p, **arrays):
    a = p.arrays
    a.update({k: jnp.asarray(v) for k, v in arrays.items()})
    return Payload(p.codec, p.shape, p.dtype, a)


def _corrupt_cases():
    p = _valid_payload()
    s = np.asarray(p["stream"]).copy()
    n = int(p["length"][0])
    cap = s.size
    lit = int(np.flatnonzero(s[:n] < 121)[0])
    run = int(np.flatnonzero((s[:n] >= 243) & (s[:n] < 255))[0])
    cases = {}
    cases["length past the buffer"] = {"length": np.int32([cap + 1])}
    cases["negative length"] = {"length": np.int32([-1])}
    cases["stream too short"] = {"length": np.int32([n - 1])}
    cases["stream too long"] = {"length": np.int32([n + 1])}
    t = s.copy()
    t[lit] = 255  # a literal becomes a run of 14: expands past the element count
    cases["run overflows the element count"] = {"stream": t}
    t = s.copy()
    t[run + 1] = 121 if s[run + 1] != 121 else 243  # run byte < 255 then a zero
    cases["run byte followed by a zero"] = {"stream": t}
    t = s.copy()
    t[lit : lit + 2] = [121, 121]  # two lone 121s in a row
    cases["121 followed by 121"] = {"stream": t}
    cases["overflow flag not 0 or 1"] = {"overflow": np.uint8([2])}
    cases["overflow flag on a stream that fits"] = {"overflow": np.uint8([1])}
    return p, cases


_P, _CASES = _corrupt_cases()


@pytest.mark.parametrize("case", list(_CASES))
def test_corrupted_stream(case):
    bad = _with(_P, **_CASES[case])
    y = np.asarray(_dec(bad, "xla"))
    assert np.all(np.isnan(y)), "the twin decodes a corrupted stream to NaN"
    if jc.cpu_available():
        with pytest.raises(jax.errors.JaxRuntimeError, match="jaxcomp_threelc_decode"):
            jax.block_until_ready(_dec(bad, "ffi"))


@needs_ffi
@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    length=st.one_of(st.none(), st.integers(-2, 700)),
)
def test_mutated_streams_raise_exactly_when_the_twin_gives_nan(data, length):
    """Random byte changes: the FFI decoder either raises or agrees with the
    twin bit for bit; it raises exactly when the twin returns all NaN."""
    s = np.asarray(_P["stream"]).copy()
    used = int(_P["length"][0])
    for pos, val in data:
        s[pos % max(used, 1)] = val
    arrays = {"stream": s}
    if length is not None:
        arrays["length"] = np.int32([length])
    bad = _with(_P, **arrays)
    twin = np.asarray(_dec(bad, "xla"))
    try:
        got = np.asarray(_dec(bad, "ffi"))
    except jax.errors.JaxRuntimeError as e:
        assert "jaxcomp_threelc_decode" in str(e)
        assert np.all(np.isnan(twin))
    else:
        assert bits(got).tobytes() == bits(twin).tobytes()
        assert not np.all(np.isnan(twin))


# ---------------------------------------------------------------------------
# Capacity, overflow, with_capacity
# ---------------------------------------------------------------------------
def _sparse_input(n=20000, seed=5):
    return jnp.asarray(sparse_spikes(np.random.default_rng(seed), n, 0.001, 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_is_flagged_and_decodes_to_nan(backend):
    x = _sparse_input()
    full = _enc(x, ThreeLC(), backend)
    need = int(full["length"][0])
    small = ThreeLC(capacity=need - 1)
    p = _enc(x, small, backend)
    assert p["stream"].shape == (need - 1,)
    assert bool(ThreeLC.overflowed(p))
    assert int(ThreeLC.stream_length(p)) == need  # what a caller needs to choose a capacity
    assert stream_bytes(p) == stream_bytes(full)[: need - 1]  # the stream's prefix
    assert int(p.used_nbytes) == need - 1 + 9 == p.nbytes
    assert np.all(np.isnan(np.asarray(_dec(p, backend))))
    # The same capacity that fits exactly: no overflow, same numbers.
    q = _enc(x, ThreeLC(capacity=need), backend)
    assert not bool(ThreeLC.overflowed(q))
    assert bits(_dec(q, backend)).tobytes() == bits(_dec(full, backend)).tobytes()


def test_zero_capacity():
    for backend in BACKENDS:
        p = _enc(jnp.ones(10), ThreeLC(capacity=0), backend)
        assert bool(ThreeLC.overflowed(p)) and int(p.used_nbytes) == 9
        assert np.all(np.isnan(np.asarray(_dec(p, backend))))
        e = _enc(jnp.ones(0), ThreeLC(capacity=0), backend)
        assert not bool(ThreeLC.overflowed(e)) and _dec(e, backend).shape == (0,)


def test_with_capacity_round_trip():
    backend = "auto"  # cutting is backend-free; decoding at any capacity: test_golden
    x = _sparse_input(seed=8)
    codec = ThreeLC(sparsity=1.5)
    full = _enc(x, codec, backend)
    y = bits(_dec(full, backend)).tobytes()
    need = int(full["length"][0])
    cut = jax.jit(codec.with_capacity, static_argnums=1)
    for nbytes in [need, need + 1000, full.nbytes + 7]:
        p = cut(full, nbytes)
        assert p.codec == ThreeLC(sparsity=1.5, capacity=nbytes)
        assert p["stream"].shape == (nbytes,) and not bool(ThreeLC.overflowed(p))
        assert np.all(np.asarray(p["stream"])[need:] == 0)
        assert int(p.used_nbytes) == int(full.used_nbytes)
        assert bits(_dec(p, backend)).tobytes() == y
        # Identical to encoding with that capacity in the first place.
        direct = _enc(x, p.codec, backend)
        for k in p.arrays:
            assert bits(p[k]).tobytes() == bits(direct[k]).tobytes(), k
        # And back to the default capacity.
        back = p.codec.with_capacity(p, full["stream"].shape[0])
        assert bits(_dec(back, backend)).tobytes() == y
    short = codec.with_capacity(full, need - 1)
    assert bool(ThreeLC.overflowed(short))
    assert np.all(np.isnan(np.asarray(_dec(short, backend))))
    # Overflow is sticky: padding an overflowed payload does not revive it.
    assert bool(ThreeLC.overflowed(short.codec.with_capacity(short, need + 10)))
    with pytest.raises(ValueError):
        ThreeLC().with_capacity(full, need)


def test_with_capacity_under_switch():
    """The collectives pick a capacity tier with lax.switch; each branch cuts
    to its tier and decodes."""
    x = _sparse_input(seed=9)
    codec = ThreeLC()
    full = codec.encode(x)
    need = int(full["length"][0])
    tiers = [need // 2, need, 4 * need]

    def branch(tier):
        def run(p):
            cut = codec.with_capacity(p, tier)
            return cut.codec.decode(cut)

        return run

    @jax.jit
    def f(p, i):
        return jax.lax.switch(i, [branch(t) for t in tiers], p)

    want = bits(codec.decode(full)).tobytes()
    assert np.all(np.isnan(np.asarray(f(full, 0))))
    assert bits(f(full, 1)).tobytes() == want
    assert bits(f(full, 2)).tobytes() == want


def test_default_capacity_is_the_no_zre_size():
    c = ThreeLC()
    assert c.layout((1000,))["stream"].shape == (200,)
    assert c.layout((1001,))["stream"].shape == (201,)
    assert c.wire_nbytes((1000,)) == 200 + 9
    assert ThreeLC(capacity=7).wire_nbytes((1000,)) == 7 + 9


# ---------------------------------------------------------------------------
# Bits per element on data of known ternary statistics
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p_zero", [0.5, 0.9, 0.99, 0.999])
def test_used_length_on_known_ternary_data(backend, p_zero):
    """x = q exactly (max 1, s = 1): the digits are the chosen q, so the used
    length is the reference's, and near its expectation for i.i.d. q."""
    n = 200_000
    rng = np.random.default_rng(int(p_zero * 1000))
    q = np.where(rng.random(n) < p_zero, 0, np.where(rng.random(n) < 0.5, -1, 1))
    q[0] = 1
    p = _enc(jnp.asarray(q.astype(np.float32)), ThreeLC(), backend)
    want = ref_zre(ref_base3(q))
    assert stream_bytes(p) == want
    # Expected length for i.i.d. bytes, zero with probability z = p_zero^5:
    # each non-zero byte is one byte; each run of length L costs ceil(L / 14).
    z = p_zero**5
    m = -(-n // 5)
    # E[bytes] = m(1 - z) + E[number of chunk heads]; a zero byte at run
    # position k (1-based) heads a chunk when k = 1 mod 14.
    k = np.arange(1, 2000)
    heads = m * (1 - z) * np.sum(z ** k[(k - 1) % 14 == 0])
    expected = m * (1 - z) + heads
    assert abs(len(want) - expected) <= 6 * np.sqrt(m) + 20
    assert int(p.used_nbytes) == len(want) + 9


# ---------------------------------------------------------------------------
# Configuration and wire format
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"sparsity": 0.99}, "sparsity"),
        ({"sparsity": 2.0}, "sparsity"),
        ({"sparsity": 1.99999999999}, "sparsity"),  # float32(s) == 2
        ({"sparsity": float("nan")}, "sparsity"),
        ({"sparsity": True}, "sparsity"),
        ({"sparsity": "1.5"}, "sparsity"),
        ({"capacity": -1}, "capacity"),
        ({"capacity": 1.5}, "capacity"),
        ({"capacity": True}, "capacity"),
        ({"capacity": 2**31}, "capacity"),
    ],
)
def test_invalid_configuration(kwargs, param):
    with pytest.raises(ValueError, match=param):
        ThreeLC(**kwargs)


def test_config_is_keyword_only_and_hashable():
    with pytest.raises(TypeError):
        ThreeLC(1.5)  # type: ignore[misc]
    assert ThreeLC(sparsity=1) == ThreeLC() and hash(ThreeLC(sparsity=1)) == hash(ThreeLC())
    assert jc.codecs.get("threelc", sparsity=1.5) == ThreeLC(sparsity=1.5)
    assert ThreeLC.codec_id == 7


@pytest.mark.parametrize("codec", [ThreeLC(), ThreeLC(sparsity=1.1, capacity=50)])
def test_wire_round_trip(codec):
    x = _sparse_input(n=1003)
    p = codec.encode(x)
    b = wire.to_bytes(p)
    q = wire.from_bytes(b)
    assert q.codec == codec and wire.to_bytes(q) == b
    assert bits(codec.decode(q)).tobytes() == bits(codec.decode(p)).tobytes()


def test_wire_rejects_bad_params():
    b = bytearray(wire.to_bytes(ThreeLC().encode(jnp.ones(10))))
    import struct
    import zlib

    struct.pack_into("<q", b, 20, struct.unpack("<q", struct.pack("<d", 2.5))[0])
    struct.pack_into("<I", b, len(b) - 4, zlib.crc32(bytes(b[:-4])))
    with pytest.raises(jc.WireFormatError, match="sparsity"):
        wire.from_bytes(bytes(b))
