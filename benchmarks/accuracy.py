"""Accuracy parity: a student MLP on a random teacher's labels
(examples/teacher) trained with every codec, with and without error
feedback, against a float32 all-reduce; the same model, data stream,
initialization, steps and hyperparameters for every row, several seeds,
differences paired by seed. The layout follows Table 1 of the 3LC paper (Lim
et al., SysML 2019): accuracy, its difference from float32, and traffic.

    python benchmarks/accuracy.py                 # full study, updates docs/accuracy.md
    python benchmarks/accuracy.py --seeds 0 1 --only QSGD --no-docs   # a quick look
    python benchmarks/accuracy.py --lm            # also the shorter LM study
    python benchmarks/accuracy.py --only 3LC --merge   # rerun some rows, keep the rest
    python benchmarks/accuracy.py --render        # tables and plot again from the JSON

Run from the repository root. Writes benchmarks/results/accuracy.json, and
for a full run (no --only) or --merge the tables between the markers in
docs/accuracy.md and the plot docs/accuracy.png. Without --lm, the LM
results of the previous JSON (if any) are carried over unchanged.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import dataclasses
import json
import math
import pathlib
import shlex
import time
from typing import NamedTuple

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jaxcomp as jc  # noqa: E402
from examples.lm import train as lm_train  # noqa: E402
from examples.lm.configs import default as lm_default  # noqa: E402
from examples.teacher import train as teacher_train  # noqa: E402
from examples.teacher.configs import default as teacher_default  # noqa: E402

BEGIN, END = "<!-- accuracy:begin -->", "<!-- accuracy:end -->"
LM_BEGIN, LM_END = "<!-- lm:begin -->", "<!-- lm:end -->"


class Row(NamedTuple):
    label: str
    codec: str  # a common.parse_codec spec
    error_feedback: bool = True
    algorithm: str = "auto"
    server_error_feedback: bool = True


# Error feedback is listed for every lossy codec; "no EF" rows for the codecs
# whose papers differ (QSGD and TernGrad are unbiased and were proposed
# without it) or where it shows what error feedback buys.
ROWS = [
    Row("float32", "float32", False),
    Row("bfloat16", "cast:dtype=bfloat16"),
    Row("Int8", "int8"),
    Row("QSGD-8", "qsgd:bits=8"),
    Row("QSGD-4", "qsgd:bits=4"),
    Row("Natural", "natural"),
    Row("TernGrad", "terngrad"),
    Row("OneBit", "onebit"),
    Row("3LC (s=1.00)", "threelc:sparsity=1.0"),
    Row("3LC (s=1.50)", "threelc:sparsity=1.5"),
    Row("TopK (1%)", "topk:fraction=0.01"),
    Row("Int8, no EF", "int8", False),
    Row("QSGD-4, no EF", "qsgd:bits=4", False),
    Row("TernGrad, no EF", "terngrad", False),
    Row("OneBit, no EF", "onebit", False),
    Row("TopK (1%), no EF", "topk:fraction=0.01", False),
    # One compression per device and step (allgather) instead of
    # algorithm="auto"'s two-phase all-reduce (docs/collectives.md).
    Row("OneBit, allgather", "onebit", True, "allgather"),
    Row("TernGrad, allgather", "terngrad", True, "allgather"),
    Row("3LC (s=1.00), allgather", "threelc:sparsity=1.0", True, "allgather"),
    Row("3LC (s=1.50), allgather", "threelc:sparsity=1.5", True, "allgather"),
    Row("QSGD-4, allgather", "qsgd:bits=4", True, "allgather"),
    # The two-phase all-reduce with two-level error feedback for the codecs
    # whose "auto" is allgather on 8 devices (Codec.recompression): what
    # that choice avoids.
    Row("OneBit, two-phase", "onebit", True, "two_phase"),
    Row("TernGrad, two-phase", "terngrad", True, "two_phase"),
    Row("3LC (s=1.50), two-phase", "threelc:sparsity=1.5", True, "two_phase"),
    # The two-phase all-reduce with its one-level error feedback: the second
    # compression's error charged to the chunk's owner.
    Row("OneBit, old two-phase", "onebit", True, "two_phase", False),
    Row("TernGrad, old two-phase", "terngrad", True, "two_phase", False),
    Row("3LC (s=1.00), old two-phase", "threelc:sparsity=1.0", True, "two_phase", False),
    Row("3LC (s=1.50), old two-phase", "threelc:sparsity=1.5", True, "two_phase", False),
    Row("QSGD-4, old two-phase", "qsgd:bits=4", True, "two_phase", False),
    # Block-scaled floating point: FP8 with a float32 scale per 256 values,
    # and the OCP MX formats (an E8M0 scale per 32 values).
    Row("FP8 E4M3", "fp8"),
    Row("FP8 E5M2", "fp8:format=e5m2"),
    Row("MXFP8 (E4M3)", "mx"),
    Row("MXFP6 (E2M3)", "mx:element=e2m3"),
    Row("MXFP4 (E2M1)", "mx:element=e2m1"),
    Row("MXFP4 (E2M1), stochastic", "mx:element=e2m1,stochastic=true"),
    Row("FP8 E4M3, no EF", "fp8", False),
    Row("MXFP8 (E4M3), no EF", "mx", False),
    Row("MXFP4 (E2M1), no EF", "mx:element=e2m1", False),
    Row("MXFP4 (E2M1), stochastic, no EF", "mx:element=e2m1,stochastic=true", False),
    # PowerSGD (jc.optax.powersgd): low rank, all-reduced factors, warm start.
    Row("PowerSGD (rank 4)", "powersgd:rank=4"),
    Row("PowerSGD (rank 2)", "powersgd:rank=2"),
    Row("PowerSGD (rank 1)", "powersgd:rank=1"),
    Row("PowerSGD (rank 4), no warm start", "powersgd:rank=4,warm_start=false"),
    Row("PowerSGD (rank 1), no warm start", "powersgd:rank=1,warm_start=false"),
    Row("PowerSGD (rank 4), no EF", "powersgd:rank=4", False),
]

# Parity targets: accuracy at most ACC_TARGET pp below float32 and held-out
# loss at most LOSS_TARGET % above it (mean paired differences), the accuracy
# difference's standard error at most SE_TARGET pp.
PARITY = (
    "Int8",
    "QSGD-4",
    "OneBit",
    "3LC (s=1.00)",
    "TopK (1%)",
    "PowerSGD (rank 4)",
    "MXFP4 (E2M1)",
)
ACC_TARGET, LOSS_TARGET, SE_TARGET = 0.5, 2.0, 0.15
# Indistinguishable from float32: |mean difference| <= 2 standard errors,
# for the accuracy and for the loss.
INDISTINGUISHABLE = ("bfloat16", "QSGD-8", "FP8 E4M3", "MXFP8 (E4M3)")

LM_ROWS = [
    Row("float32", "float32", False),
    Row("Int8", "int8"),
    Row("QSGD-4", "qsgd:bits=4"),
    Row("OneBit", "onebit"),
    Row("3LC (s=1.00)", "threelc:sparsity=1.0"),
    Row("TopK (1%)", "topk:fraction=0.01"),
]


def unavailable(row: Row) -> str | None:
    """Why ``row`` cannot run with this jaxcomp, or None."""
    name = row.codec.partition(":")[0]
    if name == "powersgd":
        return None if hasattr(jc.optax, "powersgd") else "jc.optax.powersgd not available"
    if name != "float32" and name not in jc.codecs.names():
        return "codec not available in this build"
    return None


def compressed_size(config) -> int:
    """The values compress_gradients compresses for the teacher task's student
    (the leaves of at least min_compress_size values: its kernels)."""
    import jax
    import jax.numpy as jnp

    model = teacher_train.MLP(hidden=tuple(config.hidden), num_classes=config.num_classes)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, config.input_dim)))
    sizes = [math.prod(a.shape) for a in jax.tree.leaves(shapes)]
    return sum(n for n in sizes if n >= config.min_compress_size)


def resolved_algorithm(row: Row, config) -> str:
    """The all-reduce the row ran: what algorithm="auto" picks (one fused
    bucket of the kernels here), or the algorithm the row names."""
    if row.codec == "float32":
        return "pmean"
    if row.codec.startswith("powersgd"):
        return "low-rank pmean"
    if row.algorithm != "auto":
        return row.algorithm
    codec = teacher_train.common.parse_codec(row.codec).build()
    n = compressed_size(config)
    return jc.collectives.choose_algorithm(codec, n, config.num_devices)


def run_rows(rows, make_config, train_fn, seeds, metric_keys, log, resolve=None):
    """Runs every (row, seed); returns ({label: {...per-seed lists...}},
    {label: why skipped}). ``resolve(row, config)`` names the all-reduce."""
    resolve = resolve or (lambda row, config: row.algorithm)
    out, skipped = {}, {}
    for row in rows:
        why = unavailable(row)
        if why:
            log(f"{row.label}: skipped ({why})")
            skipped[row.label] = why
            continue
        runs, walls = [], []
        for seed in seeds:
            t0 = time.perf_counter()
            r = train_fn(make_config(row, seed), verbose=False)
            walls.append(time.perf_counter() - t0)
            runs.append(r)
            shown = "  ".join(f"{k} {r[k]:.4f}" for k in metric_keys)
            log(
                f"{row.label:28s} seed {seed}: {shown}  bits/elt {r['bits_per_element']:.3f}  "
                f"[{walls[-1]:.1f} s]"
            )
        out[row.label] = {
            "codec": row.codec,
            "error_feedback": row.error_feedback and row.codec != "float32",
            "algorithm": row.algorithm,
            "resolved_algorithm": resolve(row, make_config(row, seeds[0])),
            "server_error_feedback": row.server_error_feedback,
            # whether a second compression's error had a residual of its own
            "two_level": row.server_error_feedback,
            "seeds": list(seeds),
            **{k: [float(r[k]) for r in runs] for k in metric_keys},
            "bits_per_element": float(np.mean([r["bits_per_element"] for r in runs])),
            "wire_bytes": float(np.mean([r["wire_bytes"] for r in runs])),
            "train_seconds": [float(r["train_seconds"]) for r in runs],
            "wall_seconds": walls,
        }
    return out, skipped


def _paired(results: dict, label: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """The row's and float32's values of ``key`` on the seeds both ran."""
    base = dict(zip(results["float32"]["seeds"], results["float32"][key], strict=True))
    mine = dict(zip(results[label]["seeds"], results[label][key], strict=True))
    seeds = [s for s in results[label]["seeds"] if s in base]
    return np.array([mine[s] for s in seeds]), np.array([base[s] for s in seeds])


def _mean_se(d: np.ndarray) -> tuple[float, float]:
    """Mean, and its standard error: sd of the values / sqrt(count)."""
    if len(d) < 2:
        return float(d.mean()), float("nan")
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


def summarize(results: dict) -> list[dict]:
    """Per row: accuracy and loss, their paired differences from float32 (same
    seed: same initialization, data stream and test set) with standard errors,
    whether they are resolved (|mean| > 2 SE), and the targets."""
    base_wire = results["float32"]["wire_bytes"]
    rows = []
    for label, r in results.items():
        acc, base_acc = _paired(results, label, "test_accuracy")
        loss, base_loss = _paired(results, label, "test_loss")
        acc, base_acc = 100.0 * acc, 100.0 * base_acc
        d_acc, se_acc = _mean_se(acc - base_acc)
        with np.errstate(invalid="ignore"):
            d_loss, se_loss = _mean_se(100.0 * (loss / base_loss - 1.0))
        row = {
            "label": label,
            "codec": r["codec"],
            "error_feedback": r["error_feedback"],
            "algorithm": r["algorithm"],
            "resolved_algorithm": r.get("resolved_algorithm", r["algorithm"]),
            "server_error_feedback": r.get("server_error_feedback", True),
            "two_level": r.get("two_level", r.get("server_error_feedback", True)),
            "seeds": len(acc),
            "accuracy": float(acc.mean()),
            "accuracy_sd": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
            "loss": float(loss.mean()),
            "diff": d_acc,
            "diff_se": se_acc,
            "diff_min": float((acc - base_acc).min()),
            "diff_max": float((acc - base_acc).max()),
            "loss_diff_pct": d_loss,
            "loss_diff_se": se_loss,
            "resolved": bool(abs(d_acc) > 2 * se_acc),
            "loss_resolved": bool(abs(d_loss) > 2 * se_loss),
            "bits_per_element": r["bits_per_element"],
            "wire_ratio": base_wire / r["wire_bytes"] if r["wire_bytes"] else float("inf"),
            "seconds_per_run": float(np.mean(r.get("wall_seconds", r["train_seconds"]))),
        }
        if label in PARITY:
            # One-sided: ending above float32 (or with a lower loss) is no miss.
            row["target"] = f"≥ -{ACC_TARGET} pp, ≤ +{LOSS_TARGET:g}%, SE ≤ {SE_TARGET}"
            row["met"] = bool(
                d_acc >= -ACC_TARGET and d_loss <= LOSS_TARGET and se_acc <= SE_TARGET
            )
        elif label in INDISTINGUISHABLE:
            row["target"] = "within ± 2 SE"
            row["met"] = not row["resolved"] and not row["loss_resolved"]
        rows.append(row)
    return rows


def _design(r: dict) -> tuple[str, str]:
    ef = "yes" if r["error_feedback"] else ("" if r["codec"] == "float32" else "no")
    alg = r["resolved_algorithm"]
    if r["algorithm"] == "auto" and r["codec"] != "float32":
        alg += " (auto)"
    if r["error_feedback"] and r["resolved_algorithm"] in ("two_phase", "ring"):
        alg += ", two-level EF" if r["two_level"] else ", one-level EF"
    return ef, alg


def teacher_table(rows, seeds, skipped) -> str:
    lines = [
        "| design | EF | all-reduce | test accuracy (%) | Δ accuracy (pp) ± SE | "
        "held-out loss | Δ loss (%) ± SE | resolved (acc, loss) | bits/element | "
        "traffic reduction | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ef, alg = _design(r)
        acc = f"{r['accuracy']:.2f} ± {r['accuracy_sd']:.2f}"
        loss = f"{r['loss']:.4f}" if np.isfinite(r["loss"]) else "NaN (diverged)"
        if np.isfinite(r["loss"]) and r["loss"] >= 100:
            loss = f"{r['loss']:.0f}"
        if r["codec"] == "float32":
            d_acc = d_loss = resolved = ""
        else:
            d_acc = f"{r['diff']:+.2f} ± {r['diff_se']:.2f}"
            d_loss = "n/a"
            if np.isfinite(r["loss_diff_pct"]):
                fmt = "+.2f" if abs(r["loss_diff_pct"]) < 1000 else "+.1e"
                d_loss = f"{r['loss_diff_pct']:{fmt}} ± {r['loss_diff_se']:{fmt[1:]}}"
            resolved = (
                f"{'yes' if r['resolved'] else 'no'}, "
                f"{'yes' if r['loss_resolved'] else 'no' if np.isfinite(r['loss_diff_pct']) else 'n/a'}"
            )
        target = ""
        if "target" in r:
            target = f"{r['target']}: {'met' if r['met'] else '**missed**'}"
        lines.append(
            f"| {r['label']} | {ef} | {alg} | {acc} | {d_acc} | {loss} | {d_loss} | {resolved} | "
            f"{r['bits_per_element']:.2f} | {r['wire_ratio']:.1f}x | {target} |"
        )
    text = "\n".join(lines) + f"\n\nSeeds: {', '.join(map(str, seeds))}."
    if skipped:
        text += "\n\nNot run: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + "."
    return text


def lm_summarize(results: dict) -> list[dict]:
    """The LM study's rows: held-out loss and its paired difference."""
    base_wire = results["float32"]["wire_bytes"]
    rows = []
    for label, r in results.items():
        v, base = _paired(results, label, "test_loss")
        d = v - base
        rows.append(
            {
                "label": label,
                "codec": r["codec"],
                "error_feedback": r["error_feedback"],
                "mean": float(v.mean()),
                "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                "diff": float(d.mean()),
                "diff_std": float(d.std(ddof=1)) if len(d) > 1 else 0.0,
                "bits_per_element": r["bits_per_element"],
                "wire_ratio": base_wire / r["wire_bytes"] if r["wire_bytes"] else float("inf"),
            }
        )
    return rows


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
    """A forest plot: each row's paired accuracy difference from float32,
    mean ± 2 SE, in the table's order, with its bits per element."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["codec"] != "float32"]
    fig, ax = plt.subplots(figsize=(8.5, 2.0 + 0.27 * len(rows)))
    ax.axvspan(-ACC_TARGET, ACC_TARGET, color="0.9", label=f"float32 ± {ACC_TARGET} pp")
    ax.axvline(0.0, color="0.4", lw=1, ls="--")
    lo, hi = -4.0, 1.0  # rows beyond are drawn at the edge, with their value
    styles = {  # legend, colour, marker
        "ef": ("error feedback, algorithm='auto'", "C0", "o"),
        "noef": ("no error feedback", "C3", "s"),
        "allgather": ("error feedback, allgather", "C2", "D"),
        "old": ("error feedback, two-phase with one-level EF", "C1", "^"),
    }
    seen = set()
    for y, r in enumerate(rows):
        if not r["error_feedback"]:
            kind = "noef"
        elif not r["server_error_feedback"]:
            kind = "old"
        elif r["algorithm"] == "allgather":
            kind = "allgather"
        else:
            kind = "ef"
        name, color, marker = styles[kind]
        label = None if kind in seen else name
        seen.add(kind)
        d = r["diff"]
        if d < lo:
            ax.plot(lo + 0.05, y, "<", color=color, label=label)
            ax.annotate(
                f"{d:+.1f} pp",
                (lo + 0.05, y),
                textcoords="offset points",
                xytext=(8, -3),
                fontsize=7,
                color=color,
            )
            continue
        ax.errorbar(
            d,
            y,
            xerr=2 * r["diff_se"],
            fmt=marker,
            color=color,
            mfc="white" if kind == "noef" else None,
            capsize=2.5,
            ms=5,
            label=label,
        )
    ax.set_yticks(
        range(len(rows)),
        [f"{r['label']} ({r['bits_per_element']:.2f} bits)" for r in rows],
        fontsize=7.5,
    )
    ax.invert_yaxis()
    ax.set_xlim(lo, hi)
    ax.set_xlabel("test accuracy minus float32's, same seed (pp): mean ± 2 SE")
    ax.set_title("Teacher-student MLP, 8 data-parallel devices", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.45, -0.06), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def replace_between(text: str, begin: str, end: str, body: str) -> str:
    i, j = text.index(begin) + len(begin), text.index(end)
    return text[:i] + "\n" + body + "\n" + text[j:]


def write_docs(teacher_rows, seeds, skipped, lm_rows=None, lm_seeds=None) -> None:
    """The tables between the markers of docs/accuracy.md (the LM table only
    if ``lm_rows``) and docs/accuracy.png."""
    doc = ROOT / "docs" / "accuracy.md"
    text = replace_between(doc.read_text(), BEGIN, END, teacher_table(teacher_rows, seeds, skipped))
    if lm_rows:
        text = replace_between(text, LM_BEGIN, LM_END, lm_table(lm_rows, lm_seeds))
    doc.write_text(text)
    plot(teacher_rows, ROOT / "docs" / "accuracy.png")
    print(f"updated {doc} and docs/accuracy.png")


def render(path: pathlib.Path, no_docs: bool) -> int:
    """--render: the summary, the tables and the plot again from the JSON."""
    record = json.loads(path.read_text())
    t = record["teacher"]
    t["summary"] = summarize(t["runs"])
    path.write_text(json.dumps(record, indent=1) + "\n")
    seeds, skipped = t["runs"]["float32"]["seeds"], t.get("skipped", {})
    print(teacher_table(t["summary"], seeds, skipped))
    if not no_docs:
        write_docs(t["summary"], seeds, skipped)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(6)))
    ap.add_argument("--steps", type=int, help="teacher-task steps (default: configs/default.py)")
    ap.add_argument(
        "--only",
        nargs="*",
        help="only rows whose label contains one of these ('=LABEL': exactly that label)",
    )
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
    ap.add_argument(
        "--render",
        action="store_true",
        help="train nothing: recompute the summary of the existing JSON and regenerate "
        "the tables and the plot from it",
    )
    args = ap.parse_args()
    if args.render:
        return render(pathlib.Path(args.json), args.no_docs)

    rows = ROWS
    if args.only:

        def wanted(label: str) -> bool:
            return any(label == s[1:] if s.startswith("=") else s in label for s in args.only)

        rows = [r for r in ROWS if r.label == "float32" or wanted(r.label)]
    base = teacher_default.get_config()
    if args.steps:
        base = dataclasses.replace(base, steps=args.steps)
    base = dataclasses.replace(base, log_every=base.steps)

    def teacher_config(row: Row, seed: int):
        return dataclasses.replace(
            base,
            codec=row.codec,
            error_feedback=row.error_feedback,
            algorithm=row.algorithm,
            server_error_feedback=row.server_error_feedback,
            seed=seed,
        )

    t0 = time.perf_counter()
    teacher, skipped = run_rows(
        rows,
        teacher_config,
        teacher_train.train_and_evaluate,
        args.seeds,
        ["test_accuracy", "test_loss"],
        lambda s: print(s, flush=True),
        resolve=resolved_algorithm,
    )
    previous = None
    if pathlib.Path(args.json).is_file():
        previous = json.loads(pathlib.Path(args.json).read_text())
    if args.merge and previous is not None and "teacher" in previous:
        merged = dict(previous["teacher"]["runs"])
        merged.update(teacher)
        teacher = {r.label: merged[r.label] for r in ROWS if r.label in merged}
        skipped = {
            k: v
            for k, v in {**previous["teacher"].get("skipped", {}), **skipped}.items()
            if k not in teacher
        }
    seeds = teacher["float32"]["seeds"]
    teacher_rows = summarize(teacher)
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "teacher": {
            "config": dataclasses.asdict(base),
            "runs": teacher,
            "skipped": skipped,
            "summary": teacher_rows,
        },
        "seconds": None,
    }
    lm_rows, lm_seeds = None, args.lm_seeds
    if args.lm:
        lm_base = dataclasses.replace(
            lm_default.get_config(), steps=args.lm_steps, log_every=args.lm_steps
        )

        def lm_config(row: Row, seed: int):
            return dataclasses.replace(
                lm_base, codec=row.codec, error_feedback=row.error_feedback, seed=seed
            )

        lm, _ = run_rows(
            LM_ROWS,
            lm_config,
            lm_train.train_and_evaluate,
            args.lm_seeds,
            ["test_loss", "test_accuracy"],
            lambda s: print("LM " + s, flush=True),
        )
        lm_rows = lm_summarize(lm)
        record["lm"] = {"config": dataclasses.asdict(lm_base), "runs": lm, "summary": lm_rows}
    elif previous is not None and "lm" in previous:
        record["lm"] = previous["lm"]  # carried over unchanged
    record["seconds"] = time.perf_counter() - t0
    if args.merge and previous is not None:
        record["merged_into"] = previous.get("command")

    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {out} ({record['seconds']:.0f} s)")
    print("\n" + teacher_table(teacher_rows, seeds, skipped))
    if lm_rows:
        print("\n" + lm_table(lm_rows, lm_seeds))
    if not args.no_docs and (args.merge or not args.only):
        write_docs(teacher_rows, seeds, skipped, lm_rows, lm_seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
