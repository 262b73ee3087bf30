"""Codec throughput: encode and decode GB/s of float32 input for every codec
and backend at 2^16..2^26 elements, beside a memcpy of the same buffer
measured in the same run.

    python benchmarks/codecs.py                      # full sweep, updates docs/benchmarks.md
    python benchmarks/codecs.py --log2-sizes 16 20   # quick look, no docs update
    python benchmarks/codecs.py --platform gpu       # the CUDA kernels (needs a GPU)

Writes benchmarks/results/codecs.json and, for the full sweep, replaces the
section between the markers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import jax

from jaxcomp import _bench

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--log2-sizes", type=int, nargs="+", default=[16, 18, 20, 22, 24, 26])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--platform",
        choices=["cpu", "gpu"],
        default="cpu",
        help="where the inputs live: the CPU kernels or the CUDA kernels (with their twins)",
    )
    ap.add_argument("--json", default=None, help="default: benchmarks/results/codecs[-gpu].json")
    ap.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    args = ap.parse_args()

    gpu = args.platform == "gpu"
    tag = "codecs-gpu" if gpu else "codecs"
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    sizes = [1 << e for e in args.log2_sizes]
    with jax.default_device(jax.devices(args.platform)[0]):
        rows = _bench.measure(_bench.default_codecs(), sizes, reps=args.reps, log=print)
    env = _bench.environment()
    out = pathlib.Path(args.json or ROOT / "benchmarks" / "results" / f"{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "rows": [r.__dict__ for r in rows]}, indent=1))
    print(f"wrote {out}")

    command = "python benchmarks/codecs.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    headline = 1 << 24 if (1 << 24) in sizes else max(sizes)
    where = (
        f"{env['device_kind']}, jax {env['jax']}). Median of >= {args.reps} jitted calls; "
        "GB/s of float32 input; memcpy = a device-to-device copy (elementwise negation) of the "
        "same buffer in the same run."
        if gpu
        else f"{env['cpu_count']} cores, jax {env['jax']}, CPU kernels: {env['cpu_kernel_isa']}). "
        f"Median of >= {args.reps} jitted calls; GB/s of float32 input; memcpy = `np.copyto` "
        "of the same buffer in the same run."
    )
    section = "\n".join(
        [
            begin,
            f"Command: `{command.strip()}` ({where}",
            "",
            f"### n = 2^{headline.bit_length() - 1}",
            "",
            _bench.markdown(rows, n=headline),
            "",
            "### All sizes",
            "",
            _bench.markdown(rows),
            end,
        ]
    )
    if not args.no_docs and len(sizes) > 1:
        doc = ROOT / "docs" / "benchmarks.md"
        text = doc.read_text() if doc.exists() else f"# Benchmarks\n\n{begin}\n{end}\n"
        if begin not in text:
            text += f"\n{begin}\n{end}\n"
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        doc.write_text(head + section + tail)
        print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
