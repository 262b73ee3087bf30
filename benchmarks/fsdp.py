"""Sharded training, measured. On the byte-level LM (examples/lm,
``--shard-params``): bytes per step per device read from the compiled
step's HLO, memory per device (the compiled step's memory analysis and the
persistent state as laid out), and held-out loss at equal steps, sharded
float32 against compressed collectives, paired by seed. The same loss study
on a second task, a transformer that learns to sort (benchmarks/sort_task.py).

    python benchmarks/fsdp.py --bytes --memory        # HLO and memory tables (minutes)
    python benchmarks/fsdp.py --accuracy              # the loss study (long: run it niced)
    python benchmarks/fsdp.py --accuracy --only hsdp-qsgd4-ef --seeds 0   # one row, one seed
    python benchmarks/fsdp.py --accuracy --task sort  # the sort task (benchmarks/sort_task.py)
    python benchmarks/fsdp.py --render                # tables again from the JSON

Run from the repository root, on 8 simulated CPU devices. Each part merges
its results into benchmarks/results/fsdp.json (accuracy runs one by one, so
an interrupted study keeps what finished) and writes its tables between
the markers of docs/fsdp.md.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import collections
import dataclasses
import json
import pathlib
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "fsdp.json"
DOC = ROOT / "docs" / "fsdp.md"
DATE = "2026-12-02"


@dataclasses.dataclass(frozen=True)
class Design:
    """One configuration of the LM's step."""

    label: str
    describe: str
    shard: bool = True
    codec: str = "float32"  # the gradient reduce-scatter's (replicated: the all-reduce's)
    param_codec: str = "float32"  # the parameter all-gather's
    error_feedback: bool = True
    replicas: int = 1  # HSDP: replicas x (8 / replicas)
    width: int = 64  # the model's (the default config's 64, or wider)
    min_compress_size: int = 0  # leaves below it take exact collectives (the sort task's)


QSGD4 = "qsgd:bits=4"
BF16 = "cast:dtype=bfloat16"
DESIGNS = {
    d.label: d
    for d in [
        Design("replicated-f32", "replicated, float32 pmean", shard=False),
        Design(
            "replicated-qsgd4-ef", "replicated, QSGD-4 all-reduce + EF", shard=False, codec=QSGD4
        ),
        Design("sharded-f32", "sharded, float32"),
        Design("sharded-bf16", "sharded, bf16 AG + bf16 RS", codec=BF16, param_codec=BF16),
        Design(
            "sharded-int8-qsgd4-ef",
            "sharded, int8 AG + QSGD-4 RS + EF",
            codec=QSGD4,
            param_codec="int8",
        ),
        Design(
            "sharded-int8-qsgd4-ef-b64",
            "sharded, int8 AG + QSGD-4 RS + EF, 64-value buckets",
            codec="qsgd:bits=4,bucket_size=64",
            param_codec="int8:bucket_size=64",
        ),
        Design("sharded-f32-w512", "sharded, float32, width 512", width=512),
        Design(
            "sharded-int8-qsgd4-ef-w512",
            "sharded, int8 AG + QSGD-4 RS + EF, width 512",
            codec=QSGD4,
            param_codec="int8",
            width=512,
        ),
        Design(
            "sharded-int8-int8-ef",
            "sharded, int8 AG + int8 RS + EF",
            codec="int8",
            param_codec="int8",
        ),
        Design(
            "sharded-int8-int8-ef-b64",
            "sharded, int8 AG + int8 RS + EF, 64-value buckets",
            codec="int8:bucket_size=64",
            param_codec="int8:bucket_size=64",
        ),
        Design("sharded-qsgd4-ef", "sharded, float32 AG + QSGD-4 RS + EF", codec=QSGD4),
        Design("sharded-int8", "sharded, int8 AG + float32 RS", param_codec="int8"),
        Design(
            "sharded-int8-qsgd4",
            "sharded, int8 AG + QSGD-4 RS, no EF",
            codec=QSGD4,
            param_codec="int8",
            error_feedback=False,
        ),
        Design(
            "sharded-int8-qsgd4-b64",
            "sharded, int8 AG + QSGD-4 RS, no EF, 64-value buckets",
            codec="qsgd:bits=4,bucket_size=64",
            param_codec="int8:bucket_size=64",
            error_feedback=False,
        ),
        Design(
            "hsdp-qsgd4-b64",
            "HSDP 2x4, QSGD-4 on the slow axis, no EF, 64-value buckets",
            codec="qsgd:bits=4,bucket_size=64",
            replicas=2,
            error_feedback=False,
        ),
        Design("hsdp-f32", "HSDP 2x4, float32", replicas=2),
        Design("hsdp-qsgd4-ef", "HSDP 2x4, QSGD-4 on the slow axis + EF", codec=QSGD4, replicas=2),
        Design(
            "hsdp-qsgd4-ef-b64",
            "HSDP 2x4, QSGD-4 on the slow axis + EF, 64-value buckets",
            codec="qsgd:bits=4,bucket_size=64",
            replicas=2,
        ),
    ]
}
BYTES_ROWS = [
    "replicated-f32",
    "sharded-f32",
    "sharded-bf16",
    "sharded-int8-qsgd4-ef",
    "sharded-int8-qsgd4-ef-b64",
    "sharded-int8-int8-ef",
    "sharded-int8-int8-ef-b64",
    "sharded-f32-w512",
    "sharded-int8-qsgd4-ef-w512",
    "hsdp-f32",
    "hsdp-qsgd4-ef",
    "hsdp-qsgd4-ef-b64",
]
MEMORY_ROWS = [
    "replicated-f32",
    "replicated-qsgd4-ef",
    "sharded-f32",
    "sharded-int8-qsgd4-ef",
    "sharded-int8-qsgd4",
    "sharded-int8-qsgd4-b64",
    "hsdp-qsgd4-ef",
]
ACCURACY_ROWS = [
    "sharded-f32",
    "sharded-int8-qsgd4-ef",
    "sharded-qsgd4-ef",
    "sharded-int8",
    "hsdp-f32",
    "hsdp-qsgd4-ef",
    "sharded-int8-qsgd4",
    "sharded-int8-int8-ef",
    "sharded-int8-int8-ef-b64",
    "sharded-int8-qsgd4-ef-b64",
    "sharded-int8-qsgd4-b64",
    "hsdp-qsgd4-ef-b64",
    "hsdp-qsgd4-b64",
]


B64 = ("qsgd:bits=4,bucket_size=64", "int8:bucket_size=64")
# The sort task (benchmarks/sort_task.py): the recommended rows, and the
# ablations that place their cost (the gradients or the weights, error
# feedback's delay, the small leaves' buckets).
SORT_DESIGNS = {
    d.label: d
    for d in [
        Design("sort-f32", "sharded, float32"),
        Design(
            "sort-int8-qsgd4-b64",
            "sharded, int8 AG + QSGD-4 RS, no EF, 64-value buckets",
            codec=B64[0],
            param_codec=B64[1],
            error_feedback=False,
        ),
        Design(
            "sort-int8-qsgd4-ef-b64",
            "sharded, int8 AG + QSGD-4 RS + EF, 64-value buckets",
            codec=B64[0],
            param_codec=B64[1],
        ),
        Design(
            "sort-int8-int8-ef-b64",
            "sharded, int8 AG + int8 RS + EF, 64-value buckets",
            codec=B64[1],
            param_codec=B64[1],
        ),
        Design(
            "sort-qsgd4-b64",
            "sharded, float32 AG + QSGD-4 RS, no EF, 64-value buckets",
            codec=B64[0],
            error_feedback=False,
        ),
        Design(
            "sort-int8-b64", "sharded, int8 AG + float32 RS, 64-value buckets", param_codec=B64[1]
        ),
        Design(
            "sort-int8-qsgd4-b64-small-exact",
            "sharded, int8 AG + QSGD-4 RS, no EF, 64-value buckets, leaves under 4096 exact",
            codec=B64[0],
            param_codec=B64[1],
            error_feedback=False,
            min_compress_size=4096,
        ),
        Design("sort-hsdp-f32", "HSDP 2x4, float32", replicas=2),
        Design(
            "sort-hsdp-qsgd4-b64",
            "HSDP 2x4, QSGD-4 on the slow axis, no EF, 64-value buckets",
            codec=B64[0],
            replicas=2,
            error_feedback=False,
        ),
        Design(
            "sort-hsdp-qsgd4-ef-b64",
            "HSDP 2x4, QSGD-4 on the slow axis + EF, 64-value buckets",
            codec=B64[0],
            replicas=2,
        ),
    ]
}
TASKS = {  # --task: its rows, its baseline, its results key and table marker
    "lm": (DESIGNS, "sharded-f32", "accuracy"),
    "sort": (SORT_DESIGNS, "sort-f32", "accuracy-sort"),
}


def lm_config(d: Design, **kw):
    from examples.lm.configs import default

    return dataclasses.replace(
        default.get_config(),
        shard_params=d.shard,
        codec=d.codec,
        param_codec=d.param_codec,
        error_feedback=d.error_feedback,
        replicas=d.replicas,
        width=d.width,
        **kw,
    )


# -- the compiled step ---------------------------------------------------------------


def compiled_step(d: Design):
    """``(compiled step, mesh, params, state)`` of the default LM for ``d``,
    its state laid out as training lays it out."""
    import jax
    import optax

    import jaxcomp as jc
    from examples import common
    from examples.lm import train

    config = lm_config(d)
    if d.shard:
        t = train.ShardedTrainer(config)
        params, state = t.step.init(t._init(jax.random.key(0)))
        batch = t._draw(t.train_bytes, jax.random.key(1), 0)
        compiled = t.step.lower(params, state, batch).compile()
        return compiled, t.mesh, params, state
    t = train.Trainer(config)
    model = t.model

    def loss_fn(params, w):
        return train._loss_and_accuracy(model.apply({"params": params}, w[:, :-1]), w[:, 1:])

    step = jc.data_parallel(loss_fn, t.make_tx(0), t.mesh, has_aux=True)
    params, state = step.init(t.init_params(jax.random.key(0)))
    windows = np.zeros((config.global_batch_size, config.context + 1), np.int32)
    batch = jax.device_put(windows, step.batch_sharding)
    compiled = step.lower(params, state, batch).compile()
    del optax, common
    return compiled, t.mesh, params, state


def measure_bytes(d: Design) -> dict:
    from examples import common

    compiled, mesh, params, _ = compiled_step(d)
    per = collections.defaultdict(float)
    for c in common.collective_traffic(compiled.as_text(), mesh):
        per[f"{c['kind']} over {'x'.join(c['axes']) or '-'}"] += c["sent"]
    total = sum(per.values())
    slow = sum(v for k, v in per.items() if "replica" in k.split(" over ")[1])
    n = sum(int(np.prod(a.shape)) for a in __import__("jax").tree.leaves(params))
    return {
        "label": d.label,
        "total": total,
        "slow_axis": slow,
        "by_collective": dict(per),
        "num_params": n,
    }


def _nbytes_here(tree) -> int:
    """Bytes of the first device's shards of every leaf (persistent state as laid out)."""
    import jax

    return sum(int(a.addressable_shards[0].data.nbytes) for a in jax.tree.leaves(tree))


def measure_memory(d: Design) -> dict:
    compiled, _, params, state = compiled_step(d)
    m = compiled.memory_analysis()
    if d.shard:
        opt, res = state.opt_state, state.residuals
    else:
        # The chain: the all-reduce stage (its residuals) then adamw.
        opt, res = state[1:], state[0]
    row = {
        "label": d.label,
        "params": _nbytes_here(params),
        "opt_state": _nbytes_here(opt),
        "residuals": _nbytes_here(res),
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
    }
    row["persistent"] = row["params"] + row["opt_state"] + row["residuals"]
    row["peak"] = row["argument"] + row["output"] + row["temp"] - row["alias"]
    return row


# -- accuracy ----------------------------------------------------------------------


def _train_lm(d: Design, steps: int, seed: int) -> dict:
    from examples.lm import train

    config = lm_config(d, steps=steps, seed=seed, log_every=max(1, steps // 4))
    r = train.train_and_evaluate(config, verbose=False)
    keys = ("test_loss", "test_accuracy", "bits_per_element", "wire_bytes", "steps")
    return {k: r[k] for k in (*keys, "train_seconds")}


def _train_sort(d: Design, steps: int, seed: int) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sort_task

    c = sort_task.Config(
        steps=steps,
        seed=seed,
        codec=None if d.codec == "float32" else d.codec,
        param_codec=None if d.param_codec == "float32" else d.param_codec,
        error_feedback=d.error_feedback,
        replicas=d.replicas,
        min_compress_size=d.min_compress_size,
    )
    return sort_task.train(c)


def run_accuracy(task: str, labels, seeds, steps, log) -> None:
    designs, _, key = TASKS[task]
    train = _train_lm if task == "lm" else _train_sort
    for label in labels:
        for seed in seeds:
            results = load()
            done = results.setdefault(key, {}).setdefault(label, {})
            if str(seed) in done and done[str(seed)]["steps"] == steps:
                continue
            t0 = time.time()
            row = {**train(designs[label], steps, seed), "date": DATE}
            log(
                f"{label} seed {seed}: held-out loss {row['test_loss']:.4f} "
                f"({time.time() - t0:.0f} s)"
            )
            results = load()
            results.setdefault(key, {}).setdefault(label, {})[str(seed)] = row
            save(results)


def _mean_se(d: np.ndarray) -> tuple[float, float]:
    """Mean, and its standard error: sd / sqrt(count) (docs/accuracy.md)."""
    if len(d) < 2:
        return float(d.mean()), float("nan")
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


# -- tables ------------------------------------------------------------------------


def _kib(b: float) -> str:
    return f"{b / 1024:,.1f}"


def bytes_table(rows: list[dict]) -> str:
    by = {r["label"]: r for r in rows}
    lines = [
        "| design | all-gather | reduce-scatter / all-to-all | all-reduce | total | "
        "reduction vs sharded float32 | of which over the slow axis |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kinds = collections.defaultdict(float)
        for k, v in r["by_collective"].items():
            kind = k.split(" over ")[0]
            kinds["rs" if kind in ("reduce-scatter", "all-to-all") else kind] += v
        w = DESIGNS[r["label"]].width
        base = by.get("sharded-f32" if w == 64 else f"sharded-f32-w{w}")
        ratio = f"{base['total'] / r['total']:.2f}x" if base and r["total"] else ""
        slow = _kib(r["slow_axis"]) if DESIGNS[r["label"]].replicas > 1 else ""
        lines.append(
            f"| {DESIGNS[r['label']].describe} | {_kib(kinds['all-gather'])} | "
            f"{_kib(kinds['rs'])} | {_kib(kinds['all-reduce'])} | {_kib(r['total'])} | "
            f"{ratio} | {slow} |"
        )
    sizes = sorted({(DESIGNS[r["label"]].width, r["num_params"]) for r in rows})
    sizes = "; ".join(f"width {w}: {n:,} parameters" for w, n in sizes)
    return "\n".join(lines) + (
        f"\n\nKiB sent per device per step ({sizes}), 8 simulated CPU devices; the "
        "reduction is against sharded float32 of the same width. "
        "HSDP's compressed all-reduce over the slow axis runs as an all-gather of the "
        "payloads (`jc.psum`'s allgather algorithm for two devices): it is in the all-gather "
        "column, and all of the slow axis's bytes are in the last one."
    )


def memory_table(rows: list[dict]) -> str:
    ref = {r["label"]: r for r in rows}
    lines = [
        "| design | parameters | optimizer state | residuals | persistent | "
        "vs sharded float32 | vs replicated | arguments | temp | peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a = ref.get("sharded-f32")
        b = ref.get("replicated-qsgd4-ef")
        va = f"{r['persistent'] / a['persistent']:.2f}x" if a else ""
        vb = f"{r['persistent'] / b['persistent']:.3f}x" if b else ""
        lines.append(
            f"| {DESIGNS[r['label']].describe} | {_kib(r['params'])} | {_kib(r['opt_state'])} | "
            f"{_kib(r['residuals'])} | {_kib(r['persistent'])} | {va} | {vb} | "
            f"{_kib(r['argument'])} | {_kib(r['temp'])} | {_kib(r['peak'])} |"
        )
    return "\n".join(lines) + (
        "\n\nKiB per device. Persistent: the first device's shards of the parameters and the "
        "state as laid out (exact); arguments, temp and peak (arguments + outputs + temp - "
        "aliased) from `compiled.memory_analysis()` of the step (arguments include the "
        'batch). "vs replicated": against replicated data parallelism with QSGD-4 and '
        "error feedback."
    )


def accuracy_table(acc: dict, task: str = "lm") -> str:
    designs, base_label, _ = TASKS[task]
    if base_label not in acc:
        return "(not measured)"
    base = acc[base_label]
    unit = "nats/byte" if task == "lm" else "nats/token"
    lines = [
        f"| design | seeds | held-out loss ({unit}) | relative difference per seed (%) | "
        "absolute difference per seed | mean difference (%) ± SE | measured |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = ACCURACY_ROWS if task == "lm" else list(SORT_DESIGNS)
    order = [k for k in rows if k in acc] + [k for k in acc if k not in rows]
    for label, runs in ((k, acc[k]) for k in order):
        seeds = sorted(runs, key=int)
        loss = np.array([runs[s]["test_loss"] for s in seeds])
        line = (
            f"| {designs[label].describe} | {', '.join(seeds)} | {loss.mean():.4f} "
            f"± {loss.std(ddof=1) if len(loss) > 1 else 0:.4f} |"
        )
        paired = [s for s in seeds if s in base]
        date = ", ".join(sorted({runs[s].get("date", "?") for s in seeds}))
        if label == base_label or not paired:
            lines.append(line + f" | | | {date} |")
            continue
        rel = np.array([100.0 * (runs[s]["test_loss"] / base[s]["test_loss"] - 1) for s in paired])
        diff = [runs[s]["test_loss"] - base[s]["test_loss"] for s in paired]
        m, se = _mean_se(rel)
        per = ", ".join(f"{v:+.2f}" for v in rel)
        absolute = ", ".join(f"{v:+.4f}" for v in diff)
        lines.append(line + f" {per} | {absolute} | {m:+.2f} ± {se:.2f} | {date} |")
    steps = {r["steps"] for runs in acc.values() for r in runs.values()}
    return "\n".join(lines) + (
        f"\n\nHeld-out loss after {', '.join(map(str, sorted(steps)))} steps (mean ± sd over "
        "the seeds); the difference is paired by seed (same initialization and data) against "
        "sharded float32, its standard error the sd of the per-seed differences / sqrt(seeds)."
    )


def replace_between(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- fsdp:{name} -->", f"<!-- /fsdp:{name} -->"
    if begin not in text or end not in text:
        return text
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render(results: dict) -> None:
    tables = {}
    if "bytes" in results:
        tables["bytes"] = bytes_table(results["bytes"])
    if "memory" in results:
        tables["memory"] = memory_table(results["memory"])
    if "accuracy" in results:
        tables["accuracy"] = accuracy_table(results["accuracy"])
    if "accuracy-sort" in results:
        tables["accuracy-sort"] = accuracy_table(results["accuracy-sort"], "sort")
    for name, t in tables.items():
        print(f"\n{name}\n{t}")
    if DOC.exists():
        text = DOC.read_text()
        for name, t in tables.items():
            text = replace_between(text, name, t)
        DOC.write_text(text)


def load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def save(results: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", action="store_true", help="bytes per step from the HLO")
    ap.add_argument("--memory", action="store_true", help="memory per device")
    ap.add_argument("--accuracy", action="store_true", help="held-out loss, paired by seed")
    ap.add_argument("--render", action="store_true", help="tables from the JSON only")
    ap.add_argument(
        "--task", choices=sorted(TASKS), default="lm", help="--accuracy's task (lm: the LM)"
    )
    ap.add_argument(
        "--only", nargs="+", choices=sorted({**DESIGNS, **SORT_DESIGNS}), help="these rows only"
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="400 for the LM, 300 for sort")
    args = ap.parse_args()

    def log(msg):
        print(msg, flush=True)

    def measured(part, rows, measure):
        for label in rows:
            if args.only and label not in args.only:
                continue
            row = measure(DESIGNS[label])
            log(f"{part} {label}: {row}")
            results = load()
            have = {r["label"]: r for r in results.get(part, [])}
            have[label] = row
            results[part] = [have[k] for k in rows if k in have]
            results["date"] = DATE
            save(results)

    if args.bytes:
        measured("bytes", BYTES_ROWS, measure_bytes)
    if args.memory:
        measured("memory", MEMORY_ROWS, measure_memory)
    if args.accuracy:
        rows = ACCURACY_ROWS if args.task == "lm" else list(SORT_DESIGNS)
        steps = args.steps or (400 if args.task == "lm" else 300)
        run_accuracy(args.task, args.only or rows, args.seeds, steps, log)
    render(load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
