"""Error feedback's compression, ``codec.encode_feedback(x, residual)``, in
one pass against the three calls it replaces, on the CPU or a GPU.

    python benchmarks/feedback.py                  # 2^24 float32, the fused codecs
    python benchmarks/feedback.py --log2-n 22 --reps 5
    python benchmarks/feedback.py --codecs topk:fraction=0.01 int8
    python benchmarks/feedback.py --platform gpu --log2-n 26   # the CUDA one-pass kernels

Per codec with a fused kernel (``feedback_kernel``; on a GPU,
``cuda_feedback_kernel``): the fused kernel;
the same result from the separate kernels (``acc = x + residual``, encode,
decode, ``acc - decoded``: what ``jc.optax.compress_gradients`` computes
today); the twins of both (``backend="xla"``). Each is timed as a jitted
loop that carries the residual from one call to the next, as training
does, and the payload (which XLA would otherwise not write from the
twins' fusion), beside a floor measured in the same run: a pass that reads
the gradient and the residual and writes the new residual (``x + r / 2``,
no codec). GB/s of float32 gradient; x floor: the row's time over that
pass's.
"""

from __future__ import annotations

import argparse

import jax

import jaxcomp as jc
from jaxcomp import _bench


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--log2-n", type=int, default=24)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--codecs", nargs="+", help="codec specs (default: every fused example)")
    ap.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument(
        "--skip-kernel-calls",
        action="store_true",
        help="leave out the separate kernels' path (add, encode, decode, subtract)",
    )
    args = ap.parse_args()
    with jax.default_device(jax.devices(args.platform)[0]):
        return run(args)


def run(args) -> int:
    gpu = args.platform == "gpu"
    n = 1 << args.log2_n
    # On the device and carried through the loops as operands: a gradient
    # captured by the traced functions would be compiled in as a constant
    # (hundreds of megabytes of it on a GPU, a slow compile).
    dev = jax.devices(args.platform)[0]
    x = jax.device_put(_bench.make_input(n, seed=1), dev)
    r0 = jax.device_put(_bench.make_input(n, seed=2) * 0.1, dev)
    key = jax.random.key(0)

    def seconds(step, carry):
        once = jax.jit(lambda c: step(0, c))
        single = _bench._median_seconds(lambda: once(carry), args.reps, 0.2)
        return _bench._loop_seconds(step, carry, single, args.reps, 0.2)

    def carrying(path):
        """``path(i, x, r) -> (payload, r)`` as a loop step that carries the
        payload's arrays too, so that XLA cannot drop a payload nobody reads
        (it would, from the twins' fusion, and not from a kernel's), and
        the gradient, unchanged."""

        def step(i, carry):
            payload, r = path(i, carry[2], carry[1])
            return payload.arrays, r, carry[2]

        shapes = jax.eval_shape(lambda r: step(0, ({}, r, x)), r0)[0]
        zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)
        return step, (zeros, r0, x)

    floor = seconds(lambda i, c: (c[0] + c[1] * 0.5, c[1]), (r0, x))
    gbps = 4 * n / 1e9
    print(
        f"{n} float32 values on {jax.devices(args.platform)[0].device_kind}; {jc._ffi.kernels_line()}"
    )
    print(f"floor (read x and r, write r): {floor * 1e3:.2f} ms, {gbps / floor:.1f} GB/s")
    print("| codec | path | ms | GB/s of gradient | x floor |")
    print("|---|---|---|---|---|")
    if args.codecs:
        codecs = [jc.codecs.get(spec) for spec in args.codecs]
    else:
        fused_here = "cuda_feedback_kernel" if gpu else "feedback_kernel"
        codecs = [c for c in _bench.default_codecs() if getattr(c, fused_here)]
    for codec in codecs:

        def fused(i, x, r, codec=codec, backend="ffi"):
            return codec.encode_feedback(x, r, jax.random.fold_in(key, i), backend=backend)

        def by_calls(i, x, r, codec=codec, backend="ffi"):
            acc = x + r
            payload = codec.encode(acc, jax.random.fold_in(key, i), backend=backend)
            return payload, acc - codec.decode(payload, backend=backend)

        def encode_kernel(i, x, r, codec=codec):
            # compress_gradients' separate calls on a GPU: the encode
            # kernel, the decode fused into the subtraction.
            acc = x + r
            payload = codec.encode(acc, jax.random.fold_in(key, i), backend="ffi")
            return payload, acc - codec.decode(payload, backend="xla")

        paths = [
            ("fused kernel", fused),
            ("kernels: add, encode, decode, subtract", by_calls),
            ("encode kernel, decode fused by XLA", encode_kernel),
            ("twins, fused by XLA", lambda i, x, r, f=fused: f(i, x, r, backend="xla")),
        ]
        if not gpu:
            paths = [p for p in paths if p[0] != "encode kernel, decode fused by XLA"]
        if args.skip_kernel_calls:
            paths = [p for p in paths if p[0] != "kernels: add, encode, decode, subtract"]
        if gpu and not codec.cuda_feedback_kernel:
            paths = paths[1:]  # "ffi" would run the twins there
        for label, step in paths:
            t = seconds(*carrying(step))
            print(f"| `{codec}` | {label} | {t * 1e3:.2f} | {gbps / t:.1f} | {t / floor:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
