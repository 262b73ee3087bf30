"""Codec throughput measurement, shared by ``python -m jaxcomp bench`` and
benchmarks/codecs.py.

Each figure is a median over repetitions of a jitted call, in GB/s of
float32 input, measured in the same run as a memcpy of the same buffer
(``np.copyto`` into a preallocated buffer: a single-threaded copy that pays
no page faults) so that ratios are comparable on a noisy machine.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import _ffi
from jaxcomp.codecs.base import Codec
from jaxcomp.payload import Payload


def default_codecs() -> list[Codec]:
    """The configurations users pick of every registered codec
    (``examples()``), Identity (no kernel: the baseline) aside."""
    from jaxcomp import codecs as c

    return [codec for cls in c.registered() if cls is not c.Identity for codec in cls.examples()]


@dataclasses.dataclass
class Row:
    codec: str
    backend: str
    n: int
    bits_per_element: float
    encode_gbps: float  # steady state: inside a jitted loop, buffers reused
    decode_gbps: float  # steady state
    decode_call_gbps: float  # one jitted call per decode: a fresh output buffer each time
    memcpy_gbps: float

    @property
    def encode_vs_memcpy(self) -> float:
        return self.encode_gbps / self.memcpy_gbps

    @property
    def decode_vs_memcpy(self) -> float:
        return self.decode_gbps / self.memcpy_gbps


def _median_seconds(fn: Callable[[], object], reps: int, min_time: float) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 50 * reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _loop_seconds(step, carry, single: float, reps: int, min_time: float) -> float:
    """Seconds per iteration of ``step`` run in a jitted ``fori_loop``.

    Inside one XLA computation the loop's buffers are planned once and reused,
    as they are inside a training step; a standalone call instead pays for a
    freshly allocated (page-faulting) output every time. The loop itself costs
    a copy of its carry in and a fresh carry out per call, so two loop lengths
    are timed and the difference divided by the extra iterations.
    """
    extra = max(4, min(64, int(0.2 / max(single, 1e-6))))
    short = jax.jit(lambda c: jax.lax.fori_loop(0, 2, step, c))
    long = jax.jit(lambda c: jax.lax.fori_loop(0, 2 + extra, step, c))
    t_short = _median_seconds(lambda: short(carry), reps, min_time)
    t_long = _median_seconds(lambda: long(carry), reps, min_time)
    per = (t_long - t_short) / extra
    return per if per > 0 else t_long / (2 + extra)  # noise: fall back to the plain average


def _touch(payload: Payload, acc: jax.Array) -> Payload:
    """The payload with a data dependency on acc (value unchanged), so that a
    loop cannot hoist or merge the decodes."""
    name = next(iter(payload.arrays))
    arrays = payload.arrays
    a = arrays[name]
    if a.size:
        bump = (acc * 0).astype(a.dtype)
        arrays[name] = a.at[0].set(a[0] + bump)
    return Payload(payload.codec, payload.shape, payload.dtype, arrays)


def _last(a: jax.Array) -> jax.Array:
    return a.reshape(-1)[-1].astype(jnp.float32) if a.size else jnp.float32(0)


def memcpy_gbps(host: np.ndarray, reps: int = 10) -> float:
    dst = np.empty_like(host)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, host)
        times.append(time.perf_counter() - t0)
    return host.nbytes / statistics.median(times) / 1e9


def device_copy_gbps(x: jax.Array, reps: int = 5, min_time: float = 0.2) -> float:
    """GB/s of a copy on the accelerator that holds ``x`` (an elementwise
    negation: one read and one write of every element, as memcpy does),
    timed in a jitted loop like the codecs."""
    single = _median_seconds(functools.partial(jax.jit(jnp.negative), x), reps, min_time)
    per = _loop_seconds(lambda i, y: -y, x, single, reps, min_time)
    return x.nbytes / per / 1e9


def make_input(n: int, seed: int = 0) -> jax.Array:
    """Gradient-like float32: normal values with log-normal magnitudes."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (n,)) * jnp.exp(jax.random.normal(k2, (n,)))
    return jax.block_until_ready(x.astype(jnp.float32))


def measure_one(codec: Codec, backend: str, x: jax.Array, reps: int, min_time: float):
    """(encode s, decode s, standalone decode s, payload bytes) for one input."""
    key = jax.random.key(0)
    enc = jax.jit(lambda x, k: codec.encode(x, k, backend=backend))
    dec = jax.jit(lambda p: codec.decode(p, backend=backend))
    payload = jax.block_until_ready(enc(x, key))
    te_call = _median_seconds(functools.partial(enc, x, key), reps, min_time)
    td_call = _median_seconds(functools.partial(dec, payload), reps, min_time)

    # Outputs are loop carries, so every element is computed in every
    # iteration (a twin would otherwise be fused down to the elements used).
    def enc_step(i, carry):
        x, _ = carry
        # The barrier keeps the in-place update out of the twin's fusions.
        x = jax.lax.optimization_barrier(x.at[0].set(i.astype(x.dtype)))
        return x, codec.encode(x, jax.random.fold_in(key, i), backend=backend)

    def dec_step(i, carry):
        p, _ = carry
        y = codec.decode(p, backend=backend)
        return jax.lax.optimization_barrier(_touch(p, _last(y))), y

    te = _loop_seconds(enc_step, (x, payload), te_call, reps, min_time)
    td = _loop_seconds(dec_step, (payload, dec(payload)), td_call, reps, min_time)
    # Bytes a payload of this input really needs (below the static size only
    # for variable-rate codecs: ThreeLC's used stream).
    return te, td, td_call, int(payload.used_nbytes)


# Largest input the TopK twin is timed on.
TOPK_TWIN_MAX = 1 << 20


def measure(
    codecs: Sequence[Codec],
    sizes: Sequence[int],
    backends: Sequence[str] = ("ffi", "xla"),
    reps: int = 5,
    min_time: float = 0.2,
    log: Callable[[str], None] | None = None,
) -> list[Row]:
    """Encode/decode throughput of every codec x backend x size."""
    rows = []
    for n in sizes:
        x = make_input(n)
        on_cpu = x.devices().pop().platform == "cpu"
        mc = memcpy_gbps(np.asarray(x)) if on_cpu else device_copy_gbps(x, reps, min_time)
        kernels = _ffi.cpu_available() if on_cpu else _ffi.cuda_available()
        for codec in codecs:
            for backend in backends:
                if backend == "ffi" and not kernels:
                    continue
                if on_cpu and backend == "xla" and codec.name == "topk" and n > TOPK_TWIN_MAX:
                    continue  # lax.top_k sorts the whole tensor on the CPU: too slow to time here
                te, td, td_call, nbytes = measure_one(codec, backend, x, reps, min_time)
                row = Row(
                    codec=repr(codec),
                    backend=backend,
                    n=n,
                    bits_per_element=8 * nbytes / n,
                    encode_gbps=4 * n / te / 1e9,
                    decode_gbps=4 * n / td / 1e9,
                    decode_call_gbps=4 * n / td_call / 1e9,
                    memcpy_gbps=mc,
                )
                rows.append(row)
                if log:
                    log(
                        f"n=2^{n.bit_length() - 1} {row.codec:44s} {backend:3s} "
                        f"enc {row.encode_gbps:6.2f} GB/s ({row.encode_vs_memcpy:4.2f}x memcpy)  "
                        f"dec {row.decode_gbps:6.2f} GB/s ({row.decode_vs_memcpy:4.2f}x)  "
                        f"dec/call {row.decode_call_gbps:6.2f}  {row.bits_per_element:5.2f} bits/elt"
                    )
    return rows


def environment() -> dict[str, object]:
    import os

    return {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_kernel_isa": _ffi.cpu_isa(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
    }


def markdown(rows: Sequence[Row], n: int | None = None) -> str:
    """A table: one line per codec (and size), the FFI kernels beside the twins."""
    by_key: dict[tuple[str, int], dict[str, Row]] = {}
    for r in rows:
        if n is None or r.n == n:
            by_key.setdefault((r.codec, r.n), {})[r.backend] = r
    lines = [
        "| codec | n | bits/elt | memcpy GB/s | FFI encode GB/s (x memcpy) | FFI decode GB/s (x memcpy) "
        "| FFI decode, fresh output | twin encode | twin decode | FFI/twin encode | FFI/twin decode |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (codec, size), b in by_key.items():
        f, t = b.get("ffi"), b.get("xla")
        ref = f or t
        assert ref is not None

        def cell(r, attr, ratio=None):
            if r is None:
                return "-"
            v = getattr(r, attr)
            return f"{v:.2f}" + (f" ({getattr(r, ratio):.2f}x)" if ratio else "")

        speed_e = f"{f.encode_gbps / t.encode_gbps:.1f}x" if f and t else "-"
        speed_d = f"{f.decode_gbps / t.decode_gbps:.1f}x" if f and t else "-"
        lines.append(
            f"| `{codec}` | 2^{size.bit_length() - 1} | {ref.bits_per_element:.2f} | {ref.memcpy_gbps:.1f} "
            f"| {cell(f, 'encode_gbps', 'encode_vs_memcpy')} | {cell(f, 'decode_gbps', 'decode_vs_memcpy')} "
            f"| {cell(f, 'decode_call_gbps')} | {cell(t, 'encode_gbps')} | {cell(t, 'decode_gbps')} "
            f"| {speed_e} | {speed_d} |"
        )
    return "\n".join(lines)
