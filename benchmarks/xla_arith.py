"""Which float32 operations a platform's XLA code rounds as IEEE 754 does.

The twins (jaxcomp/codecs, jaxcomp/ops) can only give the kernels' bytes
where XLA computes each operation the way the kernels do. This script checks,
on a platform (``--platform gpu`` or ``cpu``), every kind of operation the
codecs use, against numpy (correctly rounded, subnormals kept):

- ``a / b``, ``c / m`` for the codecs' constants, ``sqrt``;
- ``a * b + c``: a fused multiply-add (one rounding) where XLA contracts;
- the halving-tree sum of jaxcomp.ops.bucket (the order of the kernels);
- ``round`` (ties to even) and ``floor``;
- subnormal operands and results (flushed or kept);
- the bits of NaNs that arithmetic creates;
- conversions float32 -> bfloat16/float16/FP8 and between the 16-bit types.

The counts are the evidence for docs/codecs.md's per-backend rules ("One
answer").

    python benchmarks/xla_arith.py --platform gpu [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def _inputs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three float32 vectors of random signs and magnitudes over 2^-20..2^20."""
    rng = np.random.default_rng(seed)

    def one():
        mag = np.exp2(rng.uniform(-20, 20, n)).astype(np.float32)
        mant = rng.uniform(1, 2, n).astype(np.float32)
        return (mag * mant * np.where(rng.random(n) < 0.5, -1, 1)).astype(np.float32)

    return one(), one(), one()


def _tree_sum_np(a: np.ndarray) -> np.ndarray:
    w = a.shape[1] // 2
    while w >= 1:
        a = (a[:, :w] + a[:, w : 2 * w]).astype(np.float32)
        w //= 2
    return a[:, 0]


def _count(got, want) -> dict:
    got, want = np.asarray(got), np.asarray(want)
    u = np.dtype(f"u{got.dtype.itemsize}")
    g, w = got.reshape(-1).view(u), want.reshape(-1).view(u)
    bad = np.flatnonzero(g != w)
    out = {"differ": int(bad.size), "of": int(g.size)}
    if bad.size:
        i = int(bad[0])
        out["first"] = [i, hex(int(g[i])), hex(int(w[i]))]
    return out


def probe(platform: str, n: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxcomp.ops import bucket as bk

    dev = jax.devices(platform)[0]
    a, b, c = _inputs(n, 0)
    put = lambda *xs: [jax.device_put(x, dev) for x in xs]  # noqa: E731
    run = lambda f, *xs: np.asarray(jax.jit(f)(*put(*xs)))  # noqa: E731
    r = {}
    with np.errstate(all="ignore"):
        r["a / b"] = _count(run(lambda x, y: x / y, a, b), a / b)
        for k in (127.0, 15.0, 7.0, 3.0, 1.0, 448.0, 57344.0, 6.0):
            r[f"{k:g} / m"] = _count(
                run(lambda y, k=k: np.float32(k) / jnp.abs(y), b), np.float32(k) / np.abs(b)
            )
        cnt = np.random.default_rng(1).integers(1, 65537, n).astype(np.float32)
        r["sum / count"] = _count(run(lambda x, y: x / y, a, cnt), a / cnt)
        r["sqrt"] = _count(run(jnp.sqrt, np.abs(a)), np.sqrt(np.abs(a)))
        r["a * b + c"] = _count(run(lambda x, y, z: x * y + z, a, b, c), a * b + c)
        r["a * b - c"] = _count(run(lambda x, y, z: x * y - z, a, b, c), a * b - c)
        for bucket in (8, 512, 4096):
            rows = a[: n // bucket * bucket].reshape(-1, bucket)
            r[f"tree_sum B={bucket}"] = _count(run(bk.tree_sum, rows), _tree_sum_np(rows))
        half = (np.round(a) + np.float32(0.5)).astype(np.float32)
        r["round (ties)"] = _count(run(jnp.round, half), np.rint(half))
        r["round"] = _count(run(jnp.round, a / 8), np.rint(a / 8))
        r["floor(x + u)"] = _count(
            run(lambda x, u: jnp.floor(x + u), a / 8, np.abs(c) / 2**20),
            np.floor(a / 8 + np.abs(c) / 2**20),
        )
        tiny = np.float32(np.finfo(np.float32).tiny)
        sub = (a / np.abs(a) * tiny * np.random.default_rng(2).uniform(0, 1, n)).astype(np.float32)
        # Operands from arrays, so that XLA cannot fold x * 1 or x + 0 away.
        ones, zeros = np.ones(n, np.float32), np.zeros(n, np.float32)
        r["subnormal * 1"] = _count(run(lambda x, o: x * o, sub, ones), sub)
        r["subnormal + 0"] = _count(run(lambda x, z: x + z, sub, zeros), sub)
        r["tiny * 0.5 (subnormal result)"] = _count(
            run(lambda x, h: x * h, np.abs(sub) + tiny, ones / 2), (np.abs(sub) + tiny) * 0.5
        )
        r["subnormal > 0"] = _count(run(lambda x: x > 0, sub), sub > 0)
        specials = np.array([0, np.inf, -np.inf, 1, -1, np.nan], np.float32)
        x, y = np.meshgrid(specials, specials)
        for name, f in {
            "x * y": lambda p, q: p * q,
            "x - y": lambda p, q: p - q,
            "x / y": lambda p, q: p / q,
        }.items():
            got = run(f, x.ravel(), y.ravel())
            r[f"NaN bits of {name}"] = sorted(
                {hex(int(v)) for v in got.view(np.uint32)[np.isnan(got)]}
            )
        r["NaN bits of sqrt(-1)"] = hex(int(run(jnp.sqrt, np.float32([-1])).view(np.uint32)[0]))

        # Conversions: random bit patterns (every class of value), compared
        # with the other platform's XLA (numpy has no FP8 or bfloat16 rule of
        # its own to trust here).
        cpu = jax.devices("cpu")[0]
        bits = np.random.default_rng(3).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        f32 = bits.view(np.float32)
        h16 = bits.astype(np.uint16)
        sources = {
            "float32": f32,
            "bfloat16": h16.view(jnp.bfloat16),
            "float16": h16.view(np.float16),
        }
        for src, xs in sources.items():
            for dst in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
                if dst == src:
                    continue
                f = jax.jit(lambda v, d=dst: lax.convert_element_type(v, jnp.dtype(d)))
                here = np.asarray(f(jax.device_put(xs, dev)))
                there = np.asarray(f(jax.device_put(xs, cpu)))
                r[f"convert {src} -> {dst} (vs XLA:CPU)"] = _count(here, there)
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--platform", default="gpu")
    parser.add_argument("--n", type=int, default=1 << 22)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    import jax

    print(f"jax {jax.__version__}, {jax.devices(args.platform)[0].device_kind}")
    result = {"probe": probe(args.platform, args.n)}
    for k, v in result["probe"].items():
        print(f"{k:45s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
