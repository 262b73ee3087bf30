"""The train step users run, on one device: what compression costs in compute.

One jitted ``jc.data_parallel`` step (forward, backward, the optax chain)
of an MLP of ``--layers`` square float32 matrices on a one-device mesh,
uncompressed (``lax.pmean`` + SGD) against every codec through
``jc.optax.compress_gradients`` (error feedback on), PowerSGD and
``onebit_adam`` (against plain Adam). On one device the all-reduce moves
nothing, so the time over the plain step is the compression's own compute:
"+ ms", and the gradient's bytes over it, "GB/s of gradient" (the higher,
the cheaper the codec's passes over the gradient and the residual).

    python benchmarks/train_step.py --platform gpu               # 4 x 4096^2, batch 1024
    python benchmarks/train_step.py --platform cpu --width 512   # small, for a CPU
    python benchmarks/train_step.py --ablate qsgd:bits=4 --hlo step.hlo   # where its time goes

``--paths rule one-pass calls twins`` runs every codec row once per path
of its kernels on the GPU (``Codec.cuda_auto``, overridden here for the
row): "rule" as the codec declares it; "one-pass" the one-pass
error-feedback kernel (``encode_feedback``) with the CUDA encode and
decode; "calls" the sum, the CUDA encode kernel and the decode fused by
XLA; "twins" no CUDA kernel at all, every pass fused by XLA. The rows of
one codec then say which path its rule should pick (docs/gpu.md).

``--ablate SPEC`` runs that codec three ways instead of the table: without
error feedback, with the first level only (``server_error_feedback=False``)
and with both, and prints the kernels of each compiled step (its custom
calls by target, its fusions): the differences between the rows are what
each level of error feedback costs.

Median (and min) of ``--steps`` timed steps after two warm-up steps; every
row's loss after them is printed, so that a row that trains wrong shows.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import time

import numpy as np

ROWS = [
    ("plain pmean", None),
    ("bf16", "cast:dtype=bfloat16"),
    ("int8", "int8"),
    ("fp8 e4m3", "fp8:format=e4m3"),
    ("mxfp4", "mx:element=e2m1"),
    ("qsgd-4", "qsgd:bits=4"),
    ("onebit", "onebit"),
    ("signsgd", "signsgd"),
    ("terngrad", "terngrad"),
    ("natural", "natural"),
    ("3lc s=1", "threelc:sparsity=1.0"),
    ("topk 1%", "topk:fraction=0.01"),
    ("powersgd r4", "powersgd"),
    ("plain adam", "adam"),
    ("onebit_adam", "onebit_adam"),
]


def _tx(kind, axis, **kw):
    import optax

    import jaxcomp as jc

    def pmean():
        return jc.optax.uncompressed_mean(axis)  # the uncompressed baseline

    if kind is None:
        return optax.chain(pmean(), optax.sgd(0.01))
    if kind == "powersgd":
        return optax.chain(jc.optax.powersgd(axis, rank=4), optax.sgd(0.01))
    if kind == "adam":
        return optax.chain(pmean(), optax.adam(1e-3))
    if kind == "onebit_adam":
        return jc.optax.onebit_adam(1e-3, axis, warmup_steps=1)
    return optax.chain(jc.optax.compress_gradients(kind, axis, **kw), optax.sgd(0.01))


# The CUDA kernels "auto" runs under each --paths value (Codec.cuda_auto);
# None: the codec's own declaration.
PATHS = {
    "rule": None,
    "one-pass": frozenset({"encode", "decode", "encode_feedback"}),
    "calls": frozenset({"encode", "decode"}),
    "twins": frozenset(),
}


@contextlib.contextmanager
def _cuda_auto(spec, path):
    """The codec class of ``spec`` with ``cuda_auto`` set for ``path``
    (a benchmark's override: the library reads the class's declaration)."""
    import jaxcomp as jc

    ops = PATHS[path]
    if ops is None or spec in (None, "powersgd", "adam", "onebit_adam"):
        yield
        return
    cls = type(jc.codecs.get(spec))
    saved = cls.__dict__.get("cuda_auto", None)
    cls.cuda_auto = ops
    try:
        yield
    finally:
        if saved is None:
            del cls.cuda_auto
        else:
            cls.cuda_auto = saved


def _kernels(hlo: str) -> str:
    """The custom calls of compiled HLO by target, and its fusions."""
    calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
    fusions = len(re.findall(r"^\s*(?:ROOT )?%\S+ = \S+ fusion\(", hlo, re.M))
    listed = ", ".join(f"{t} x{c}" for t, c in sorted(calls.items())) or "none"
    return f"custom calls: {listed}; fusions: {fusions}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--platform", default="gpu")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", nargs="*", help="row names to run (default: all)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--ablate",
        metavar="SPEC",
        help="one codec without, with one and with two levels of error feedback",
    )
    ap.add_argument("--hlo", help="with --ablate: write the full step's compiled HLO here")
    ap.add_argument(
        "--paths",
        nargs="+",
        choices=sorted(PATHS),
        default=["rule"],
        help="run every codec row once per path of its GPU kernels",
    )
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    import jaxcomp as jc

    dev = jax.devices(args.platform)[0]
    mesh = jax.sharding.Mesh(np.array([dev]), ("data",))
    w, nl = args.width, args.layers
    keys = jax.random.split(jax.random.key(0), nl + 1)
    params = {f"w{i}": jax.random.normal(keys[i], (w, w)) / np.sqrt(w) for i in range(nl)}
    x = jax.random.normal(keys[-1], (args.batch, w))
    batch = jax.device_put((x, jnp.tanh(x[:, ::-1])), dev)
    params = jax.device_put(params, dev)
    n = nl * w * w
    grad_bytes = 4 * n

    def loss_fn(p, b):
        h, y = b
        for i in range(nl):
            h = jnp.tanh(h @ p[f"w{i}"]) if i < nl - 1 else h @ p[f"w{i}"]
        return jnp.mean((h - y) ** 2)

    print(
        f"device {dev.device_kind}; jax {jax.__version__}; {jc._ffi.kernels_line()}\n"
        f"params {n / 1e6:.1f}M ({grad_bytes / 1e6:.0f} MB f32 gradient); batch {args.batch}; "
        f"median of {args.steps} steps"
    )
    plan = [(name, kind, {}) for name, kind in ROWS]
    if args.paths != ["rule"]:
        # Each codec row once per path; the other rows once.
        fixed = (None, "powersgd", "adam", "onebit_adam")
        plan = [
            (name if kind in fixed else f"{name} [{path}]", kind, {"path": path})
            for name, kind in ROWS
            for path in (["rule"] if kind in fixed else args.paths)
        ]
    if args.ablate:
        plan = [
            ("plain pmean", None, {}),
            ("no feedback", args.ablate, {"error_feedback": False}),
            ("first level", args.ablate, {"server_error_feedback": False}),
            ("both levels", args.ablate, {}),
        ]
    rows, base = [], {}
    for name, kind, kw in plan:
        # The baselines always run: every "+ ms" is against one of them.
        base_name = name.split(" [")[0]
        if args.rows and base_name not in args.rows and not name.startswith("plain"):
            continue
        kw = dict(kw)
        path = kw.pop("path", "rule")
        with _cuda_auto(kind, path):
            # Traced and compiled inside: the path is read at trace time.
            step = jc.data_parallel(loss_fn, _tx(kind, "data", **kw), mesh)
            p, s = step.init(params)
            t0 = time.perf_counter()
            p, s, loss = step(p, s, batch)
            loss.block_until_ready()
            compile_s = time.perf_counter() - t0
        p, s, loss = step(p, s, batch)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            p, s, loss = step(p, s, batch)
            loss.block_until_ready()
            times.append(time.perf_counter() - t0)
        med, best = 1e3 * float(np.median(times)), 1e3 * min(times)
        if name.startswith("plain"):
            base["adam" if "adam" in name else "sgd"] = med
        ref = base["adam" if "adam" in name else "sgd"]
        extra = med - ref
        gbs = grad_bytes / (extra * 1e-3) / 1e9 if extra > 0 else float("inf")
        row = {
            "row": name,
            "ms": med,
            "min_ms": best,
            "extra_ms": extra,
            "gb_per_s": gbs,
            "compile_s": compile_s,
            "loss": float(loss),
        }
        if args.ablate:
            hlo = step.lower(p, s, batch).compile().as_text()
            row["kernels"] = _kernels(hlo)
            print(f"  {name}: {row['kernels']}", flush=True)
            if args.hlo and name == "both levels":
                with open(args.hlo, "w") as f:
                    f.write(hlo)
        if args.paths != ["rule"] and kind is not None:
            # The kernels the path put in the step: its lowered program's
            # custom calls (lowering is cheap; no second compile).
            with _cuda_auto(kind, path):
                text = step.lower(p, s, batch).as_text()
            calls = collections.Counter(re.findall(r"custom_call @(jaxcomp_\w+)", text))
            row["kernels"] = ", ".join(f"{t} x{c}" for t, c in sorted(calls.items())) or "none"
            print(f"  {name}: {row['kernels']}", flush=True)
        rows.append(row)
        print(
            f"{name:14s} {med:7.2f} ms/step (min {best:7.2f})  + {extra:6.2f} ms  "
            f"{gbs:8.1f} GB/s of gradient  compile {compile_s:5.1f} s  loss {float(loss):.4g}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.device_kind, "params": n, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
