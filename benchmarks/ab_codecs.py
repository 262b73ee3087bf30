"""Before/after throughput of the FFI kernels, for a change to the kernels.

The machine is too noisy for two separate runs of benchmarks/codecs.py to
compare; this runs the two builds in alternating processes and keeps each
one's best round.

    # once per build (the installed jaxcomp, or an unpacked wheel first on PYTHONPATH):
    python benchmarks/ab_codecs.py measure after-1.json
    PYTHONPATH=/tmp/before python benchmarks/ab_codecs.py measure before-1.json
    ...                                          # alternate, 3 rounds or more
    python benchmarks/ab_codecs.py compare "before-*.json" "after-*.json"

Only codecs both builds know are compared. GB/s of float32 input at 2^24.
"""

from __future__ import annotations

import glob
import json
import sys


def measure(out: str, log2_n: int = 24) -> None:
    from jaxcomp import _bench

    rows = _bench.measure(_bench.default_codecs(), [1 << log2_n], backends=("ffi",), reps=5)
    table = {r.codec: [r.encode_gbps, r.decode_gbps, r.memcpy_gbps] for r in rows}
    with open(out, "w") as f:
        json.dump(table, f)


def compare(before: str, after: str) -> None:
    runs = [[json.load(open(p)) for p in sorted(glob.glob(g))] for g in (before, after)]
    best = [{k: [max(r[k][i] for r in rs if k in r) for i in (0, 1)] for k in rs[0]} for rs in runs]
    print(
        "| codec | encode before | encode after | after/before | decode before | decode after | after/before |"
    )
    print("|---|---|---|---|---|---|---|")
    for k, (eb, db) in best[0].items():
        if k not in best[1]:
            continue
        ea, da = best[1][k]
        print(
            f"| `{k}` | {eb:.2f} | {ea:.2f} | {ea / eb:.2f} | {db:.2f} | {da:.2f} | {da / db:.2f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "measure":
        measure(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
