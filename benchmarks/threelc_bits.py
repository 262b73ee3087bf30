"""ThreeLC (3LC) wire size: bits per element on gradient-like data, beside the
figures of the 3LC paper (Lim, Andersen, Kaminsky, SysML 2019, section 4.5,
Table 2).

    python benchmarks/threelc_bits.py              # updates docs/benchmarks.md
    python benchmarks/threelc_bits.py --no-docs

For each sparsity multiplier s in {1.0, 1.5, 1.75, 1.9} and two synthetic
gradient-like distributions (Laplace, and Student's t with 3 degrees of
freedom, heavier-tailed), it reports the used bits per element
(``8 * payload.used_nbytes / n``, the 9 bytes of scale, length and flag
included) of a single tensor, and of the steady state with error feedback
(fresh draws each step, the residual added back as in the paper's error
accumulation buffers; mean over the last half of the steps). The paper
measured real ResNet-110 gradients and model deltas with error feedback over
a whole training run; these figures only show how the multiplier moves the
size on data of a known shape.

Writes benchmarks/results/threelc_bits.json and the section between the
``threelc-bits`` markers of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomp as jc

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- threelc-bits:begin -->", "<!-- threelc-bits:end -->"
SPARSITIES = [1.0, 1.5, 1.75, 1.9]
# Table 2 of the paper: average bits per state change (standard training steps).
PAPER = {1.0: 0.812, 1.5: 0.451, 1.75: 0.298, 1.9: 0.200}
NO_ZRE_BITS = 1.6


def draw(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "laplace":
        return rng.laplace(size=n).astype(np.float32)
    if kind == "student-t3":
        return rng.standard_t(3, size=n).astype(np.float32)
    raise ValueError(kind)


# ResNet-110's largest layers (3x3 convolutions, 64 -> 64 channels) hold
# 36864 weights; the paper compresses each layer's tensor on its own.
LAYER = 3 * 3 * 64 * 64


def _used_bits(codec, x2d: jax.Array) -> jax.Array:
    """Bits of the payloads of the rows of x2d, each encoded as one tensor."""
    p = jax.vmap(codec.encode)(x2d)
    return 8.0 * jnp.sum(p.used_nbytes.astype(jnp.float32))


def bits_single(codec, x: np.ndarray, size: int) -> float:
    x2d = jnp.asarray(x).reshape(-1, size)
    return float(jax.jit(_used_bits, static_argnums=0)(codec, x2d)) / x.size


def bits_error_feedback(codec, kind: str, n: int, size: int, steps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)

    @jax.jit
    def step(residual, g):
        acc = g + residual
        p = jax.vmap(codec.encode)(acc)
        sent = jax.vmap(codec.decode)(p)
        return acc - sent, 8.0 * jnp.sum(p.used_nbytes.astype(jnp.float32))

    residual = jnp.zeros((n // size, size), jnp.float32)
    used = []
    for _ in range(steps):
        residual, u = step(residual, jnp.asarray(draw(kind, n, rng)).reshape(-1, size))
        used.append(float(u))
    return float(np.mean(used[steps // 2 :])) / n


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--log2-n", type=int, default=22)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "threelc_bits.json"))
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    n = 1 << args.log2_n
    layers = -(-n // LAYER)
    shapes = {"one tensor": (n, n), "per layer": (layers * LAYER, LAYER)}

    rows = []
    for kind in ["laplace", "student-t3"]:
        for tensors, (total, size) in shapes.items():
            x = draw(kind, total, np.random.default_rng(0))
            for ef in (False, True):
                row = {"data": kind, "tensors": tensors, "n": total, "tensor_size": size}
                row["error_feedback"] = ef
                for s in SPARSITIES:
                    codec = jc.codecs.ThreeLC(sparsity=s)
                    if ef:
                        b = bits_error_feedback(codec, kind, total, size, args.steps, seed=1)
                    else:
                        b = bits_single(codec, x, size)
                    row[f"s={s}"] = b
                rows.append(row)
                print(row)
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "steps": args.steps, "paper": PAPER}, indent=1))
    print(f"wrote {out}")

    command = "python benchmarks/threelc_bits.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    names = {"laplace": "Laplace", "student-t3": "Student-t, 3 d.o.f."}
    lines = [
        BEGIN,
        f"Command: `{command.strip()}`. Bits per element = 8 · `used_nbytes` / n (stream "
        'bytes plus the 9 bytes of scale, length and flag per tensor). "error feedback": '
        f"mean over the last {args.steps - args.steps // 2} of {args.steps} steps, each a "
        "fresh draw plus the residual left by the previous step.",
        "",
        "| data | tensors | error feedback | "
        + " | ".join(f"s = {s:.2f}" for s in SPARSITIES)
        + " |",
        "|---|---|---|" + "---:|" * len(SPARSITIES),
        "| paper, section 4.5, Table 2 (ResNet-110 gradients and model deltas) | per layer "
        "| yes | " + " | ".join(f"{PAPER[s]:.3f}" for s in SPARSITIES) + " |",
        '| without zero-run encoding (section 3.2; Table 2\'s "No ZRE") | any | any | '
        + " | ".join(f"{NO_ZRE_BITS:.3f}" for _ in SPARSITIES)
        + " |",
    ]
    for r in rows:
        if r["tensors"] == "one tensor":
            size = f"one of 2^{args.log2_n}"
        else:
            size = f"{r['n'] // r['tensor_size']} of {r['tensor_size']}"
        lines.append(
            f"| {names[r['data']]} | {size} | {'yes' if r['error_feedback'] else 'no'} | "
            + " | ".join(f"{r[f's={s}']:.3f}" for s in SPARSITIES)
            + " |"
        )
    lines += [
        "",
        "The paper's figures are averages over a whole "
        "ResNet-110/CIFAR-10 training run on 10 workers (standard training steps), of real "
        "gradient pushes and model pulls, each layer compressed on its own, with error "
        "accumulation buffers; the synthetic rows are i.i.d. draws of a fixed shape, so they "
        "only show how s and the tensor size move the size. The floor is 8/70 = 0.114 bits "
        "(every byte 121: 14 bytes, 70 values, per output byte). m is max|x| · s over the "
        "whole tensor, so a larger tensor of the same distribution has a larger max relative "
        "to its typical value and more zeros.",
        END,
    ]
    section = "\n".join(lines)
    if not args.no_docs:
        doc = ROOT / "docs" / "benchmarks.md"
        text = doc.read_text()
        if BEGIN not in text:
            raise SystemExit(f"{doc} has no {BEGIN} marker")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        doc.write_text(head + section + tail)
        print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
