"""Compression with Adam: the byte-level LM (examples/lm) trained with AdamW
on a float32 all-reduce, with ``compress_gradients`` before AdamW for every
codec (under ``algorithm="auto"`` and under allgather), and with
``jc.optax.onebit_adam`` (1-bit Adam, Tang et al. 2021) for the codecs of its
Done-when; the same model, data, initialization, steps and schedule for
every row, several seeds, the held-out loss paired by seed against float32.

    python benchmarks/adam_study.py                    # the study, updates docs/accuracy.md
    python benchmarks/adam_study.py --seeds 0 --only OneBit --no-docs   # a quick look
    python benchmarks/adam_study.py --render           # the table again from the JSON

Run from the repository root. Writes benchmarks/results/adam.json after
every row (a stopped run keeps what it finished; ``--resume`` skips the rows
already there) and the table between the markers of docs/accuracy.md.
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
from typing import NamedTuple

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import accuracy  # noqa: E402

import jaxcomp as jc  # noqa: E402
from examples.lm import train as lm_train  # noqa: E402
from examples.lm.configs import default as lm_default  # noqa: E402

BEGIN, END = "<!-- adam:begin -->", "<!-- adam:end -->"
# The Done-when of 1-bit Adam: these onebit_adam rows within LOSS_TARGET % of
# float32 AdamW's held-out loss (mean paired difference, resolved or not).
TARGET_ROWS = ("OneBit, onebit_adam", "TopK (1%), onebit_adam", "3LC (s=1.00), onebit_adam")
LOSS_TARGET = 2.0


class Row(NamedTuple):
    label: str
    codec: str  # a common.parse_codec spec
    optimizer: str = "adamw"  # "adamw" (compress_gradients + AdamW) or "onebit_adam"
    algorithm: str = "auto"
    error_feedback: bool = True
    server_error_feedback: bool = True


_CODECS = [
    ("bfloat16", "cast:dtype=bfloat16"),
    ("Int8", "int8"),
    ("QSGD-4", "qsgd:bits=4"),
    ("QSGD-2", "qsgd:bits=2,bucket_size=128"),
    ("Natural", "natural"),
    ("TernGrad", "terngrad"),
    ("OneBit", "onebit"),
    ("SignSGD", "signsgd"),
    ("3LC (s=1.00)", "threelc:sparsity=1.0"),
    ("3LC (s=1.50)", "threelc:sparsity=1.5"),
    ("TopK (1%)", "topk:fraction=0.01"),
]
ROWS = [
    Row("float32", "float32", error_feedback=False),
    # 1-bit Adam: the momentum sent compressed after the variance froze.
    Row("Identity, onebit_adam", "identity", "onebit_adam"),
    Row("OneBit, onebit_adam", "onebit:bucket_size=256", "onebit_adam"),
    Row("TopK (1%), onebit_adam", "topk:fraction=0.01", "onebit_adam"),
    Row("3LC (s=1.00), onebit_adam", "threelc:sparsity=1.0", "onebit_adam"),
    Row("QSGD-2, onebit_adam", "qsgd:bits=2,bucket_size=128", "onebit_adam"),
    Row(
        "QSGD-2, onebit_adam, allgather", "qsgd:bits=2,bucket_size=128", "onebit_adam", "allgather"
    ),
    # compress_gradients (worker and server error feedback), then AdamW.
    *[Row(f"{name}, auto", spec) for name, spec in _CODECS],
    *[Row(f"{name}, allgather", spec, algorithm="allgather") for name, spec in _CODECS],
]


def lm_config(base, row: Row, seed: int):
    return dataclasses.replace(
        base,
        codec=row.codec,
        optimizer=row.optimizer,
        algorithm=row.algorithm,
        error_feedback=row.error_feedback,
        seed=seed,
    )


def resolved_algorithm(row: Row, config) -> str:
    """The all-reduce the row ran (what "auto" picks for the model's
    largest compressed bucket: every leaf of the LM is one bucket or less)."""
    if row.codec == "float32":
        return "pmean"
    if row.algorithm != "auto":
        return row.algorithm
    import jax

    trainer = lm_train._trainer(dataclasses.replace(config, seed=0))
    shapes = jax.eval_shape(trainer.init_params, jax.random.key(0))
    codec = lm_train.common.parse_codec(row.codec).build()
    plan = jc.optax.make_plan(
        codec,
        shapes,
        min_compress_size=0 if row.optimizer == "onebit_adam" else config.min_compress_size,
        fusion_bytes=4 << 20,
    )
    b = max(plan.buckets, key=lambda b: b.size)
    return jc.collectives.choose_algorithm(codec, b.size, config.num_devices)


def _same_as_auto(row: Row, base) -> bool:
    """An allgather row whose codec's "auto" is allgather already: one run."""
    if row.algorithm != "allgather" or row.optimizer != "adamw":
        return False
    auto = row._replace(algorithm="auto")
    return resolved_algorithm(auto, lm_config(base, auto, 0)) == "allgather"


def summarize(results: dict, freeze: int, steps: int) -> list[dict]:
    """Per row: the held-out loss, its difference from float32 paired by
    seed (percent, mean and standard error), whether it is resolved, and the
    bits per element after the warm-up of onebit_adam."""
    out = []
    for label, r in results.items():
        loss, base = accuracy._paired(results, label, "test_loss")
        d, se = accuracy._mean_se(100.0 * (loss / base - 1.0))
        bits = r["bits_per_element"]
        if r.get("optimizer") == "onebit_adam":  # the warm-up sent float32
            bits = (bits * steps - 32.0 * freeze) / (steps - freeze)
        row = {
            "label": label,
            "codec": r["codec"],
            "optimizer": r.get("optimizer", "adamw"),
            "algorithm": r["resolved_algorithm"],
            "seeds": len(loss),
            "loss": float(loss.mean()),
            "diff_pct": d,
            "diff_se": se,
            "diverged": bool(not np.all(np.isfinite(loss)) or np.any(loss > 2 * base)),
            "resolved": bool(abs(d) > 2 * se and np.any(loss != base)),
            "bits_after_warmup": float(bits),
        }
        if label in TARGET_ROWS:
            row["met"] = bool(d <= LOSS_TARGET)
        out.append(row)
    return out


def table(rows: list[dict], seeds, command: str) -> str:
    lines = [
        f"Command: `{command}` (seeds {', '.join(map(str, seeds))}; each row's held-out "
        "loss, in nats per byte, against float32 AdamW's on the same seed).",
        "",
        "| codec, method | optimizer | all-reduce | held-out loss | Δ loss (± SE) | "
        "resolved | bits/element | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        opt = "`onebit_adam`" if r["optimizer"] == "onebit_adam" else "AdamW"
        if r["label"] == "float32":
            lines.append(f"| float32 | AdamW | pmean | {r['loss']:.4f} | | | 32 | |")
            continue
        if r["diverged"]:
            diff, res = "diverged", ""
        else:
            se = "" if np.isnan(r["diff_se"]) else f" ± {r['diff_se']:.2f}"
            d = r["diff_pct"]
            diff = (f"{d:+.2f}%" if abs(d) >= 0.005 or d == 0 else f"{d:+.0e}%") + se
            res = "yes" if r["resolved"] else "no"
        target = ""
        if "met" in r:
            target = f"≤ +{LOSS_TARGET:g}%: {'met' if r['met'] else '**missed**'}"
        lines.append(
            f"| {r['label'].split(',')[0]} | {opt} | {r['algorithm']} | {r['loss']:.4f} | "
            f"{diff} | {res} | {r['bits_after_warmup']:.2f} | {target} |"
        )
    return "\n".join(lines) + "\n"


def write_docs(body: str) -> None:
    path = ROOT / "docs" / "accuracy.md"
    path.write_text(accuracy.replace_between(path.read_text(), BEGIN, END, body))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--freeze", type=int, default=0, help="onebit_adam warm-up (0: 30%% of the steps)"
    )
    ap.add_argument("--only", nargs="+", help="rows whose label starts with one of these")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "adam.json"))
    ap.add_argument("--resume", action="store_true", help="keep the rows the JSON has")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--render", action="store_true", help="only the table, from the JSON")
    args = ap.parse_args()
    path = pathlib.Path(args.json)
    if args.render:
        record = json.loads(path.read_text())
        config = record["config"]
        summary = summarize(record["runs"], config["freeze_steps"], config["steps"])
        body = table(summary, record["seeds"], record["command"])
        print(body)
        if not args.no_docs:
            write_docs(body)
        return 0

    freeze = args.freeze or max(1, 3 * args.steps // 10)
    base = dataclasses.replace(
        lm_default.get_config(), steps=args.steps, log_every=args.steps, freeze_steps=freeze
    )
    rows = [r for r in ROWS if not args.only or r.label.startswith(tuple(args.only))]
    rows = [r for r in rows if not _same_as_auto(r, base)]
    if not any(r.label == "float32" for r in rows):
        rows.insert(0, ROWS[0])  # the pairing needs it
    results = {}
    if args.resume and path.exists():
        results = json.loads(path.read_text())["runs"]
    command = "python benchmarks/adam_study.py " + shlex.join(sys.argv[1:])
    for row in rows:
        if row.label in results:
            continue
        done, _ = accuracy.run_rows(
            [row],
            lambda row, seed: lm_config(base, row, seed),
            lm_train.train_and_evaluate,
            args.seeds,
            ("test_loss", "test_accuracy"),
            print,
            resolve=resolved_algorithm,
        )
        for label, r in done.items():
            results[label] = {**r, "optimizer": row.optimizer}
        path.parent.mkdir(parents=True, exist_ok=True)
        summary = summarize(results, freeze, args.steps)
        record = {
            "command": command,
            "seeds": args.seeds,
            "config": dataclasses.asdict(base),
            "runs": results,
            "summary": summary,
        }
        path.write_text(json.dumps(record, indent=1))
    body = table(summarize(results, freeze, args.steps), args.seeds, command)
    print("\n" + body)
    if not args.no_docs and not args.only:
        write_docs(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
