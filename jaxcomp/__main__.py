"""Command line: ``python -m jaxcomp {demo,bench,info} ...``."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxcomp as jc
    from jaxcomp._bench import default_codecs, make_input

    n = args.size
    x = make_input(n, seed=args.seed)
    key = jax.random.key(args.seed)
    xs = np.asarray(x, np.float64)
    print(f"jaxcomp {jc.__version__}: compressing a gradient-like float32 tensor of {n} elements")
    print(f"{jc._ffi.kernels_line()}\n")
    header = f"{'codec':58s} {'bits/elt':>8s} {'ratio':>7s} {'wire bytes':>11s} {'rel. error':>10s} {'ffi == xla':>10s}"
    print(header)
    print("-" * len(header))
    for codec in [jc.codecs.Identity(), *default_codecs()]:
        p = jax.jit(lambda x, k, c=codec: c.encode(x, k))(x, key)
        y = np.asarray(jax.jit(lambda p, c=codec: c.decode(p))(p), np.float64)
        err = np.linalg.norm(y - xs) / np.linalg.norm(xs)
        same = "-"
        if jc.cpu_available() or jc.cuda_available():
            q = jax.jit(lambda x, k, c=codec: c.encode(x, k, backend="xla"))(x, key)
            same = (
                "yes"
                if all(np.asarray(p[k]).tobytes() == np.asarray(q[k]).tobytes() for k in p.arrays)
                else "NO"
            )
        used = int(p.used_nbytes)  # below p.nbytes only for variable-rate codecs
        print(
            f"{codec!r:58s} {8 * used / n:8.2f} {4 * n / used:6.1f}x {used:11d} "
            f"{err:10.2e} {same:>10s}"
        )
    print(
        "\nwire bytes: what the payload needs (ThreeLC: its used stream, within a buffer of "
        "the no-ZRE size);\nratio: float32 bytes / wire bytes; "
        "rel. error: ||decode(encode(x)) - x|| / ||x||"
    )
    del jnp
    return 0


def _bench(args: argparse.Namespace) -> int:
    from jaxcomp import _bench

    codecs = _bench.default_codecs()
    if args.codec:
        codecs = [c for c in codecs if any(s.lower() in repr(c).lower() for s in args.codec)]
    sizes = [1 << e for e in args.log2_sizes]
    rows = _bench.measure(codecs, sizes, backends=args.backends, reps=args.reps, log=print)
    print()
    print(_bench.markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": _bench.environment(), "rows": [r.__dict__ for r in rows]},
                f,
                indent=1,
            )
        print(f"\nwrote {args.json}")
    return 0


def _info(args: argparse.Namespace) -> int:
    import jaxcomp as jc
    from jaxcomp._bench import environment

    print(f"jaxcomp {jc.__version__}")
    for k, v in environment().items():
        print(f"{k}: {v}")
    print(f"kernels: {jc._ffi.kernels_line()}")
    print(f"codecs: {', '.join(jc.codecs.names())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomp",
        description="jaxcomp: compressed gradient communication for data-parallel JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,info}")

    p = sub.add_parser("demo", help="compress a gradient-like tensor with every codec")
    p.add_argument("--size", type=int, default=1 << 20, help="elements (default 2^20)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_demo)

    p = sub.add_parser("bench", help="encode/decode throughput of the codecs (GB/s vs memcpy)")
    p.add_argument(
        "--log2-sizes",
        type=int,
        nargs="+",
        default=[20, 24],
        metavar="E",
        help="input sizes as powers of two (default: 20 24)",
    )
    p.add_argument("--codec", nargs="*", help="only codecs whose name contains one of these")
    p.add_argument("--backends", nargs="+", default=["ffi", "xla"], choices=["ffi", "xla"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="also write the results to this JSON file")
    p.set_defaults(fn=_bench)

    p = sub.add_parser("info", help="versions, kernels and codecs available")
    p.set_defaults(fn=_info)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
