"""Regenerates tests/golden/vectors.json, the golden vectors of the wire format.

Run from the repository root with the current code::

    python tests/golden/make_golden.py

Each case stores its input tensor (raw little-endian bytes), the PRNG seed, the
wire bytes of ``to_bytes(codec.encode(x, jax.random.key(seed)))`` and the raw
bytes of ``codec.decode(from_bytes(wire))``. Inputs are generated here once and
then live in the JSON file: tests/test_golden.py never regenerates them, so a
change of numpy's generators cannot move the vectors.

Both backends, eager and under jit, must give the same bytes before anything
is written; the script refuses otherwise. Regenerate only for a deliberate
format change (see docs/wire-format.md, "Versioning") and say so in the commit.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomp as jc
from jaxcomp import wire

OUT = pathlib.Path(__file__).with_name("vectors.json")
DTYPES = {
    "float32": np.dtype(jnp.float32),
    "bfloat16": np.dtype(jnp.bfloat16),
    "float16": np.dtype(jnp.float16),
}

# (codec name, constructor kwargs, shape, input dtype, input kind)
CASES = [
    ("qsgd", {"bits": 2, "bucket_size": 8, "norm": "max"}, (37,), "float32", "normal"),
    ("qsgd", {"bits": 2, "bucket_size": 16, "norm": "l2"}, (3, 100), "bfloat16", "normal"),
    ("qsgd", {"bits": 3, "bucket_size": 16, "norm": "max"}, (1029,), "float16", "normal"),
    ("qsgd", {"bits": 3, "bucket_size": 8, "norm": "l2"}, (300,), "float32", "normal"),
    ("qsgd", {"bits": 4, "bucket_size": 32, "norm": "max"}, (7, 147), "bfloat16", "normal"),
    ("qsgd", {"bits": 4, "bucket_size": 64, "norm": "l2"}, (37,), "float16", "normal"),
    ("qsgd", {"bits": 8, "bucket_size": 64, "norm": "max"}, (1029,), "float32", "normal"),
    ("qsgd", {"bits": 8, "bucket_size": 128, "norm": "l2"}, (37,), "bfloat16", "normal"),
    ("qsgd", {}, (300,), "float32", "normal"),
    ("qsgd", {"bits": 4, "bucket_size": 8, "norm": "max"}, (37,), "float32", "special"),
    ("qsgd", {"bits": 2, "bucket_size": 8, "norm": "l2"}, (37,), "float16", "special"),
    ("qsgd", {"bits": 4, "bucket_size": 8, "norm": "max"}, (), "float32", "normal"),
    ("onebit", {"bucket_size": 8}, (37,), "float32", "normal"),
    ("onebit", {"bucket_size": 16}, (3, 100), "bfloat16", "normal"),
    ("onebit", {}, (1029,), "float16", "normal"),
    ("onebit", {"bucket_size": 8}, (37,), "float32", "special"),
    ("int8", {"bucket_size": 8}, (300,), "float16", "normal"),
    ("int8", {"bucket_size": 32}, (1029,), "float32", "normal"),
    ("int8", {}, (37,), "bfloat16", "normal"),
    ("int8", {"bucket_size": 8}, (37,), "float32", "special"),
    ("int8", {"bucket_size": 8}, (0,), "float32", "normal"),
    ("cast", {"dtype": "bfloat16"}, (1029,), "float32", "normal"),
    ("cast", {"dtype": "bfloat16"}, (37,), "float16", "special"),
    ("cast", {"dtype": "float16"}, (300,), "float32", "special"),
    ("cast", {"dtype": "float16"}, (7, 147), "bfloat16", "normal"),
    ("identity", {}, (37,), "float32", "special"),
    ("identity", {}, (3, 100), "bfloat16", "normal"),
    ("identity", {}, (1029,), "float16", "normal"),
    ("identity", {}, (2, 0), "float16", "normal"),
    ("terngrad", {"bucket_size": 8}, (37,), "float32", "normal"),
    ("terngrad", {"bucket_size": 16}, (3, 100), "bfloat16", "normal"),
    ("terngrad", {}, (1029,), "float16", "normal"),
    ("terngrad", {"bucket_size": 8}, (37,), "float32", "special"),
    ("terngrad", {"bucket_size": 8}, (), "float16", "normal"),
    ("natural", {"stochastic": True, "bucket_size": 8}, (37,), "float32", "normal"),
    ("natural", {"stochastic": False, "bucket_size": 16}, (300,), "bfloat16", "normal"),
    ("natural", {}, (1029,), "float16", "normal"),
    ("natural", {"stochastic": True, "bucket_size": 8}, (37,), "float32", "special"),
    ("natural", {"stochastic": False, "bucket_size": 8}, (37,), "float16", "special"),
    ("natural", {"stochastic": False, "bucket_size": 8}, (0,), "float32", "normal"),
    ("threelc", {"sparsity": 1.0}, (37,), "float32", "normal"),
    ("threelc", {"sparsity": 1.5}, (3, 100), "bfloat16", "normal"),
    ("threelc", {"sparsity": 1.9}, (1029,), "float16", "normal"),
    ("threelc", {"sparsity": 1.75, "capacity": 8}, (300,), "float32", "normal"),
    ("threelc", {"sparsity": 1.25, "capacity": 400}, (1029,), "float32", "normal"),
    ("threelc", {"sparsity": 1.0}, (37,), "float32", "special"),
    ("threelc", {"sparsity": 1.0}, (0,), "float32", "normal"),
    ("threelc", {"sparsity": 1.0, "capacity": 3}, (300,), "bfloat16", "normal"),
    ("topk", {"fraction": 0.1}, (37,), "float32", "normal"),
    ("topk", {"fraction": 0.05}, (3, 100), "bfloat16", "normal"),
    ("topk", {"fraction": 0.3}, (37,), "float16", "special"),
    ("topk", {"k_per_bucket": [3, 8]}, (300,), "float16", "normal"),
    ("topk", {"k_per_bucket": [6, 8]}, (37,), "float32", "special"),
    ("topk", {"k_per_bucket": [16, 512]}, (1029,), "float32", "normal"),
    ("topk", {"fraction": 0.01}, (0,), "float32", "normal"),
    ("signsgd", {"bucket_size": 8}, (37,), "float32", "special"),
    ("fp8", {"format": "e4m3", "bucket_size": 8}, (37,), "float32", "special"),
    ("fp8", {"format": "e5m2", "stochastic": True}, (300,), "bfloat16", "normal"),
    ("mx", {"element": "e4m3"}, (37,), "float32", "special"),
    ("mx", {"element": "e5m2"}, (37,), "float32", "normal"),
    ("mx", {"element": "e3m2"}, (100,), "float16", "normal"),
    ("mx", {"element": "e2m3", "stochastic": True}, (67,), "float32", "normal"),
    ("mx", {"element": "e2m1"}, (37,), "bfloat16", "special"),
]

# Values every codec and both backends must treat identically. NaN is the
# canonical quiet NaN only: the backends are not required to agree on NaN
# payload bits (see docs/wire-format.md, "Golden vectors").
_SPECIAL = np.array(
    [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -1e-40, 6e-8, -6.1e-5, 3e38, -1e5, 65504.0,
     65520.0, -70000.0, 1.0, -1.0, 0.5, 2.0**-24, 2.0**-14, -(2.0**-126), 7.0, -3.0],
    dtype=np.float32,
)  # fmt: skip


def make_input(i: int, shape: tuple[int, ...], dtype: np.dtype, kind: str) -> np.ndarray:
    """A deterministic tensor with varied magnitudes, an all-zero run and a -0.0."""
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(20261121 + i)
    x = rng.standard_normal(n).astype(np.float32)
    # Magnitudes vary by blocks of 8 so that small buckets get different scales.
    x *= np.repeat(10.0 ** rng.uniform(-3, 2, size=-(-n // 8)), 8)[:n].astype(np.float32)
    x[8:16] = 0.0
    if n > 20:
        x[20] = -0.0
    if kind == "special":
        m = min(n, len(_SPECIAL))
        x[-m:] = _SPECIAL[:m]
    with np.errstate(over="ignore"):  # values past float16's range become inf, on purpose
        return x.astype(dtype).reshape(shape)


def le_bytes(a: np.ndarray) -> bytes:
    """Raw little-endian bytes of an array (host order independent)."""
    u = np.dtype(f"u{a.dtype.itemsize}")
    return np.ascontiguousarray(a).reshape(-1).view(u).astype(u.newbyteorder("<")).tobytes()


def dump(doc: dict) -> str:
    """JSON with one line per case field, so that diffs of the file stay readable."""
    head = {k: v for k, v in doc.items() if k != "cases"}
    lines = (
        ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + [' "cases": [']
    )
    for j, case in enumerate(doc["cases"]):
        fields = [f"   {json.dumps(k)}: {json.dumps(v)}" for k, v in case.items()]
        lines += ["  {", ",\n".join(fields), "  }" + ("," if j + 1 < len(doc["cases"]) else "")]
    return "\n".join([*lines, " ]", "}", ""])


def main() -> int:
    backends = ["xla"] + (["ffi"] if jc.cpu_available() else [])
    if "ffi" not in backends:
        print("warning: CPU kernels not built; vectors checked against the xla backend only")
    cases = []
    for i, (name, params, shape, dtype_name, kind) in enumerate(CASES):
        codec = jc.codecs.get(name, **params)
        x = make_input(i, shape, DTYPES[dtype_name], kind)
        seed = 1000 + i if codec.stochastic else None
        key = None if seed is None else jax.random.key(seed, impl="threefry2x32")
        what = f"case {i} ({codec!r}, {dtype_name}{list(shape)})"
        # The vectors are defined by the eager calls; all backends must agree on them.
        wires = {wire.to_bytes(codec.encode(jnp.asarray(x), key, backend=be)) for be in backends}
        if len(wires) != 1:
            raise SystemExit(f"{what}: the backends disagree on encode")
        b = wires.pop()
        decoded = {
            le_bytes(np.asarray(codec.decode(wire.from_bytes(b), backend=be))) for be in backends
        }
        if len(decoded) != 1:
            raise SystemExit(f"{what}: the backends disagree on decode")
        out = decoded.pop()
        # Under jit the same calls must give the same bytes.
        for be in backends:
            enc = jax.jit(functools.partial(codec.encode, backend=be))
            dec = jax.jit(functools.partial(codec.decode, backend=be))
            if wire.to_bytes(enc(jnp.asarray(x), key)) != b:
                raise SystemExit(
                    f"{what}: jit(encode, backend={be!r}) differs from the eager bytes"
                )
            if le_bytes(np.asarray(dec(wire.from_bytes(b)))) != out:
                raise SystemExit(
                    f"{what}: jit(decode, backend={be!r}) differs from the eager bytes"
                )
        tag = "-".join(f"{v}" for v in params.values()) or "default"
        cases.append(
            {
                "id": f"{i:02d}-{name}-{tag}-{dtype_name}-{'x'.join(map(str, shape)) or 'scalar'}-{kind}",
                "codec": name,
                "params": params,
                "shape": list(shape),
                "dtype": dtype_name,
                "seed": seed,
                "key_words": None if key is None else [int(w) for w in jax.random.key_data(key)],
                "input": le_bytes(x).hex(),
                "wire": b.hex(),
                "decoded": out.hex(),
            }
        )
    doc = {
        "description": "Golden vectors of the jaxcomp wire format; generated by tests/golden/make_golden.py. "
        "Byte strings are hex; arrays are raw little-endian element bytes.",
        "format_version": wire.VERSION,
        "cases": cases,
    }
    OUT.write_text(dump(doc))
    print(f"wrote {len(cases)} cases, {OUT.stat().st_size} bytes, to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
