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


def default_codecs() -> list[Codec]:
    from jaxcomp import codecs as c

    return [
        c.QSGD(bits=2, bucket_size=128),
        c.QSGD(bits=4, bucket_size=512),
        c.QSGD(bits=8, bucket_size=512),
        c.QSGD(bits=4, bucket_size=512, norm="l2"),
        c.OneBit(bucket_size=64),
        c.Int8(bucket_size=512),
        c.Cast("bfloat16"),
        c.Cast("float16"),
    ]


@dataclasses.dataclass
class Row:
    codec: str
    backend: str
    n: int
    bits_per_element: float
    encode_gbps: float
    decode_gbps: float
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


def memcpy_gbps(host: np.ndarray, reps: int = 10) -> float:
    dst = np.empty_like(host)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, host)
        times.append(time.perf_counter() - t0)
    return host.nbytes / statistics.median(times) / 1e9


def make_input(n: int, seed: int = 0) -> jax.Array:
    """Gradient-like float32: normal values with log-normal magnitudes."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (n,)) * jnp.exp(jax.random.normal(k2, (n,)))
    return jax.block_until_ready(x.astype(jnp.float32))


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
    key = jax.random.key(0)
    for n in sizes:
        x = make_input(n)
        mc = memcpy_gbps(np.asarray(x))
        for codec in codecs:
            for backend in backends:
                if backend == "ffi" and not _ffi.cpu_available():
                    continue
                enc = jax.jit(lambda x, k, c=codec, b=backend: c.encode(x, k, backend=b))
                dec = jax.jit(lambda p, c=codec, b=backend: c.decode(p, backend=b))
                payload = jax.block_until_ready(enc(x, key))
                te = _median_seconds(functools.partial(enc, x, key), reps, min_time)
                td = _median_seconds(functools.partial(dec, payload), reps, min_time)
                row = Row(
                    codec=repr(codec),
                    backend=backend,
                    n=n,
                    bits_per_element=8 * payload.nbytes / n,
                    encode_gbps=4 * n / te / 1e9,
                    decode_gbps=4 * n / td / 1e9,
                    memcpy_gbps=mc,
                )
                rows.append(row)
                if log:
                    log(
                        f"n=2^{n.bit_length() - 1} {row.codec:44s} {backend:3s} "
                        f"enc {row.encode_gbps:6.2f} GB/s ({row.encode_vs_memcpy:4.2f}x memcpy)  "
                        f"dec {row.decode_gbps:6.2f} GB/s ({row.decode_vs_memcpy:4.2f}x)  "
                        f"{row.bits_per_element:5.2f} bits/elt"
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
    }


def markdown(rows: Sequence[Row], n: int | None = None) -> str:
    """A table: one line per codec (and size), FFI beside the twin."""
    by_key: dict[tuple[str, int], dict[str, Row]] = {}
    for r in rows:
        if n is None or r.n == n:
            by_key.setdefault((r.codec, r.n), {})[r.backend] = r
    lines = [
        "| codec | n | bits/elt | memcpy GB/s | FFI enc GB/s (x memcpy) | FFI dec GB/s (x memcpy) "
        "| twin enc GB/s | twin dec GB/s | FFI/twin enc | FFI/twin dec |",
        "|---|---|---|---|---|---|---|---|---|---|",
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
            f"| {cell(t, 'encode_gbps')} | {cell(t, 'decode_gbps')} | {speed_e} | {speed_d} |"
        )
    return "\n".join(lines)
