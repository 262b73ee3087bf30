"""Accuracy parity: the digits CNN (examples/image_classifier) trained with
every codec, with and without error feedback, against a float32 all-reduce;
the same model, data order, initialization, steps and hyperparameters for
every row, several seeds. The layout follows Table 1 of the 3LC paper (Lim et
al., SysML 2019): accuracy, its difference from float32, and traffic.

    python benchmarks/accuracy.py                 # full study, updates docs/accuracy.md
    python benchmarks/accuracy.py --seeds 0 --only qsgd --no-docs   # a quick look
    python benchmarks/accuracy.py --lm            # also the shorter LM study
    python benchmarks/accuracy.py --only 3LC --merge   # rerun some rows, keep the rest

Run from the repository root. Writes benchmarks/results/accuracy.json, and
for a full run (no --only) the tables between the markers in
docs/accuracy.md and the plot docs/accuracy.png.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import dataclasses
import json
import pathlib
import shlex
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jaxcomp as jc  # noqa: E402
from examples.image_classifier import train as image_train  # noqa: E402
from examples.image_classifier.configs import default as image_default  # noqa: E402
from examples.lm import train as lm_train  # noqa: E402
from examples.lm.configs import default as lm_default  # noqa: E402

BEGIN, END = "<!-- accuracy:begin -->", "<!-- accuracy:end -->"
LM_BEGIN, LM_END = "<!-- lm:begin -->", "<!-- lm:end -->"

# (label, --codec spec, error feedback). Error feedback is listed for every
# lossy codec; "without" is what the codec's own paper did where it differs
# (QSGD, TernGrad and natural compression are unbiased and were proposed
# without it; 1-bit SGD, 3LC and top-k sparsification with it).
ROWS = [
    ("float32", "float32", False),
    ("bfloat16", "cast:dtype=bfloat16", True),
    ("Int8", "int8", True),
    ("Int8, no EF", "int8", False),
    ("QSGD-8", "qsgd:bits=8", True),
    ("QSGD-8, no EF", "qsgd:bits=8", False),
    ("QSGD-4", "qsgd:bits=4", True),
    ("QSGD-4, no EF", "qsgd:bits=4", False),
    ("Natural", "natural", True),
    ("Natural, no EF", "natural", False),
    ("TernGrad", "terngrad", True),
    ("TernGrad, no EF", "terngrad", False),
    ("OneBit", "onebit", True),
    ("OneBit, no EF", "onebit", False),
    ("3LC (s=1.00)", "threelc:sparsity=1.0", True),
    ("3LC (s=1.50)", "threelc:sparsity=1.5", True),
    ("TopK (1%)", "topk:fraction=0.01", True),
    ("TopK (1%), no EF", "topk:fraction=0.01", False),
    # The same codecs with one compression per step (allgather) instead of
    # algorithm="auto"'s two-phase all-reduce, whose second compression's
    # error lands on the chunk's owner (docs/collectives.md).
    ("OneBit, allgather", "onebit", True, "allgather"),
    ("TernGrad, allgather", "terngrad", True, "allgather"),
    ("3LC (s=1.00), allgather", "threelc:sparsity=1.0", True, "allgather"),
    ("3LC (s=1.50), allgather", "threelc:sparsity=1.5", True, "allgather"),
]

# Done-when targets: |mean difference from float32| in percentage points.
TARGETS = {
    "3LC (s=1.00)": 0.5,
    "QSGD-4": 0.5,
    "Int8": 0.5,
    "OneBit": 0.5,
    "TopK (1%)": 0.5,
    "QSGD-8": 0.2,
}

LM_ROWS = [
    ("float32", "float32", False),
    ("Int8", "int8", True),
    ("QSGD-4", "qsgd:bits=4", True),
    ("OneBit", "onebit", True),
    ("3LC (s=1.00)", "threelc:sparsity=1.0", True),
    ("TopK (1%)", "topk:fraction=0.01", True),
]


def available(spec: str) -> bool:
    name = spec.partition(":")[0]
    return name == "float32" or name in jc.codecs.names()


def run_rows(rows, make_config, train_fn, seeds, metric_keys, log):
    """Runs every (row, seed); returns {label: {...per-seed lists...}}."""
    out = {}
    for label, spec, ef, *alg in rows:
        if not available(spec):
            log(f"{label}: codec not available in this build, skipped")
            continue
        runs = []
        for seed in seeds:
            t0 = time.perf_counter()
            config = make_config(spec, ef, seed)
            if alg:
                config = dataclasses.replace(config, algorithm=alg[0])
            r = train_fn(config, verbose=False)
            runs.append(r)
            shown = "  ".join(f"{k} {r[k]:.4f}" for k in metric_keys)
            log(
                f"{label:18s} seed {seed}: {shown}  bits/elt {r['bits_per_element']:.3f}  "
                f"[{time.perf_counter() - t0:.1f} s]"
            )
        out[label] = {
            "codec": spec,
            "error_feedback": ef and spec != "float32",
            "algorithm": alg[0] if alg else "auto",
            "seeds": list(seeds),
            **{k: [float(r[k]) for r in runs] for k in metric_keys},
            "bits_per_element": float(np.mean([r["bits_per_element"] for r in runs])),
            "wire_bytes": float(np.mean([r["wire_bytes"] for r in runs])),
            "train_seconds": [float(r["train_seconds"]) for r in runs],
        }
    return out


def summarize(results: dict, key: str, scale: float, targets: dict) -> list[dict]:
    """Paired differences from float32 (same seed: same init and data order)."""
    base = np.array(results["float32"][key]) * scale
    base_wire = results["float32"]["wire_bytes"]
    rows = []
    for label, r in results.items():
        v = np.array(r[key]) * scale
        d = v - base
        row = {
            "label": label,
            "codec": r["codec"],
            "error_feedback": r["error_feedback"],
            "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "diff": float(d.mean()),
            "diff_std": float(d.std(ddof=1)) if len(d) > 1 else 0.0,
            "diff_min": float(d.min()),
            "diff_max": float(d.max()),
            "bits_per_element": r["bits_per_element"],
            "wire_ratio": base_wire / r["wire_bytes"] if r["wire_bytes"] else float("inf"),
        }
        if label in targets:
            # A miss is a loss of accuracy: ending above float32 by more than
            # the target is seed noise, not a failure of the codec.
            row["target"] = targets[label]
            row["met"] = bool(row["diff"] >= -targets[label])
        rows.append(row)
    return rows


def image_table(rows, seeds) -> str:
    lines = [
        "| design | EF | test accuracy (%) | difference (pp) | spread of difference (pp) | "
        "bits/element | traffic reduction | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ef = "yes" if r["error_feedback"] else ("" if r["codec"] == "float32" else "no")
        if r["codec"] == "float32":
            diff = spread = ""
        else:
            diff = f"{r['diff']:+.2f}"
            spread = f"± {r['diff_std']:.2f} (min {r['diff_min']:+.2f}, max {r['diff_max']:+.2f})"
        target = ""
        if "target" in r:
            target = f"≥ -{r['target']}: {'met' if r['met'] else '**missed**'}"
        lines.append(
            f"| {r['label']} | {ef} | {r['mean']:.2f} ± {r['std']:.2f} | {diff} | {spread} | "
            f"{r['bits_per_element']:.2f} | {r['wire_ratio']:.1f}x | {target} |"
        )
    return "\n".join(lines) + f"\n\nSeeds: {', '.join(map(str, seeds))}."


def lm_table(rows, seeds) -> str:
    lines = [
        "| design | EF | held-out loss (nats/byte) | difference | perplexity | bits/element | traffic reduction |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ef = "yes" if r["error_feedback"] else ("" if r["codec"] == "float32" else "no")
        diff = "" if r["codec"] == "float32" else f"{r['diff']:+.4f} ± {r['diff_std']:.4f}"
        lines.append(
            f"| {r['label']} | {ef} | {r['mean']:.4f} ± {r['std']:.4f} | {diff} | "
            f"{np.exp(r['mean']):.2f} | {r['bits_per_element']:.2f} | {r['wire_ratio']:.1f}x |"
        )
    return "\n".join(lines) + f"\n\nSeeds: {', '.join(map(str, seeds))}."


def plot(rows, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.4))
    base = next(r for r in rows if r["codec"] == "float32")
    ax.axhline(base["mean"], color="0.4", lw=1, ls="--", label="float32 (mean over seeds)")
    ax.axhspan(base["mean"] - 0.5, base["mean"] + 0.5, color="0.9", label="float32 ± 0.5 pp")
    # Rows that failed to train would squash the interesting range: they are
    # drawn at the bottom edge, labelled with their accuracy.
    lo, hi = base["mean"] - 4.0, min(100.0, base["mean"] + 2.0)
    below = 0
    for r in rows:
        if r["codec"] == "float32":
            continue
        ef = r["error_feedback"]
        allgather = "allgather" in r["label"]
        color = "C2" if allgather else ("C0" if ef else "C3")
        marker = "D" if allgather else ("o" if ef else "s")
        name = r["label"].replace(", no EF", "").replace(", allgather", "")
        offset = (5, 4)
        if r["mean"] < lo:
            y = lo + 0.15
            ax.plot(r["bits_per_element"], y, "v", color=color, mfc=None if ef else "white")
            name += f": {r['mean']:.0f}%"
            offset = (5, 4 + 10 * below)
            below += 1
        else:
            y = r["mean"]
            ax.errorbar(
                r["bits_per_element"],
                y,
                yerr=r["std"],
                fmt=marker,
                mfc=None if ef else "white",
                color=color,
                capsize=3,
            )
        ax.annotate(
            name,
            (r["bits_per_element"], y),
            textcoords="offset points",
            xytext=offset,
            fontsize=7,
            color=color,
        )
    ax.plot([], [], "o", color="C0", label="with error feedback")
    ax.plot([], [], "s", color="C3", mfc="white", label="without error feedback")
    ax.plot([], [], "D", color="C2", label="error feedback, allgather")
    ax.plot([], [], "v", color="0.4", label="below the axis (accuracy in the label)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bits per gradient element on the wire (log scale)")
    ax.set_ylabel("test accuracy (%), mean ± std over seeds")
    ax.set_title("Digits CNN, 8 data-parallel devices: accuracy vs compressed traffic")
    ax.set_ylim(lo, hi)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replace_between(text: str, begin: str, end: str, body: str) -> str:
    i, j = text.index(begin) + len(begin), text.index(end)
    return text[:i] + "\n" + body + "\n" + text[j:]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--steps", type=int, help="image steps (default: configs/default.py)")
    ap.add_argument("--only", nargs="*", help="only rows whose label contains one of these")
    ap.add_argument("--lm", action="store_true", help="also run the LM study")
    ap.add_argument("--lm-steps", type=int, default=300)
    ap.add_argument("--lm-seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "accuracy.json"))
    ap.add_argument("--no-docs", action="store_true", help="do not touch docs/")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="with --only: replace those rows in the existing JSON, keep the others, "
        "and regenerate the tables and the plot from all of them",
    )
    args = ap.parse_args()

    rows = ROWS
    if args.only:
        rows = [r for r in ROWS if r[0] == "float32" or any(s in r[0] for s in args.only)]
    base = image_default.get_config()
    if args.steps:
        base = dataclasses.replace(base, steps=args.steps, log_every=args.steps)
    else:
        base = dataclasses.replace(base, log_every=base.steps)

    def image_config(spec, ef, seed):
        return dataclasses.replace(base, codec=spec, error_feedback=ef, seed=seed)

    t0 = time.perf_counter()
    image = run_rows(
        rows,
        image_config,
        image_train.train_and_evaluate,
        args.seeds,
        ["test_accuracy", "test_loss"],
        lambda s: print(s, flush=True),
    )
    previous = None
    if args.merge and pathlib.Path(args.json).is_file():
        previous = json.loads(pathlib.Path(args.json).read_text())
        merged = dict(previous["image"]["runs"])
        merged.update(image)
        image = {label: merged[label] for label, *_ in ROWS if label in merged}
    image_rows = summarize(image, "test_accuracy", 100.0, TARGETS)
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "image": {"config": dataclasses.asdict(base), "runs": image, "summary": image_rows},
        "seconds": None,
    }
    lm_rows = None
    if args.lm:
        lm_base = dataclasses.replace(
            lm_default.get_config(), steps=args.lm_steps, log_every=args.lm_steps
        )

        def lm_config(spec, ef, seed):
            return dataclasses.replace(lm_base, codec=spec, error_feedback=ef, seed=seed)

        lm = run_rows(
            LM_ROWS,
            lm_config,
            lm_train.train_and_evaluate,
            args.lm_seeds,
            ["test_loss", "test_accuracy"],
            lambda s: print("LM " + s, flush=True),
        )
        lm_rows = summarize(lm, "test_loss", 1.0, {})
        record["lm"] = {"config": dataclasses.asdict(lm_base), "runs": lm, "summary": lm_rows}
    elif previous is not None and "lm" in previous:
        record["lm"] = previous["lm"]
        lm_rows = previous["lm"]["summary"]
        args.lm_seeds = previous["lm"]["runs"]["float32"]["seeds"]
    record["seconds"] = time.perf_counter() - t0
    if previous is not None:
        record["merged_into"] = previous.get("command")

    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {out}")
    table = image_table(image_rows, args.seeds)
    print("\n" + table)
    if lm_rows:
        print("\n" + lm_table(lm_rows, args.lm_seeds))
    if not args.no_docs and (args.merge or not args.only):
        doc = ROOT / "docs" / "accuracy.md"
        text = replace_between(doc.read_text(), BEGIN, END, table)
        if lm_rows:
            text = replace_between(text, LM_BEGIN, LM_END, lm_table(lm_rows, args.lm_seeds))
        doc.write_text(text)
        plot(image_rows, ROOT / "docs" / "accuracy.png")
        print(f"updated {doc} and docs/accuracy.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
