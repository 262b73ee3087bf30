"""What the accuracy study measured for each method, as the planner shows it.

The relative change of the held-out loss against float32, in percent
(None: the run diverged), from docs/accuracy.md: ``SGD``, the
teacher-student MLP with SGD (momentum 0.5) and error feedback (two-level
where the algorithm keeps a server residual), and ``ADAM``, the byte-level
transformer LM with AdamW, or with ``jc.optax.onebit_adam`` where the key
says so. Keys are ``(method, algorithm)``: a codec spec (as
``jc.codecs.get`` reads it), ``"onebit_adam(<codec spec>)"`` or
``"powersgd:rank=<r>"``, and the algorithm the run resolved to.
tests/test_planning.py checks these against the study's results
(benchmarks/results/accuracy.json and adam.json).
"""

from __future__ import annotations

SGD: dict[tuple[str, str], float | None] = {
    ("cast:dtype=bfloat16", "two_phase"): -0.5,
    ("int8", "two_phase"): -0.12,
    ("qsgd:bits=8", "two_phase"): 0.08,
    ("qsgd:bits=4", "two_phase"): -0.1,
    ("natural", "two_phase"): -0.43,
    ("terngrad", "allgather"): 3.39,
    ("onebit", "allgather"): 4.16,
    ("threelc:sparsity=1.0", "two_phase"): 1.73,
    ("threelc:sparsity=1.5", "allgather"): 14.09,
    ("topk:fraction=0.01", "sparse"): -3.31,
    ("threelc:sparsity=1.0", "allgather"): 3.31,
    ("qsgd:bits=4", "allgather"): -0.03,
    ("onebit", "two_phase"): 11.18,
    ("terngrad", "two_phase"): None,
    ("threelc:sparsity=1.5", "two_phase"): 34.11,
    ("fp8", "two_phase"): -0.2,
    ("fp8:format=e5m2", "two_phase"): 0.09,
    ("mx", "two_phase"): -0.14,
    ("mx:element=e2m3", "two_phase"): 0.05,
    ("mx:element=e2m1", "two_phase"): 0.26,
    ("mx:element=e2m1,stochastic=true", "two_phase"): 0.38,
    ("powersgd:rank=4", "low-rank pmean"): 3.43,
    ("powersgd:rank=2", "low-rank pmean"): 8.97,
    ("powersgd:rank=1", "low-rank pmean"): 18.1,
    ("powersgd:rank=4,warm_start=false", "low-rank pmean"): 3.46,
    ("powersgd:rank=1,warm_start=false", "low-rank pmean"): 17.31,
}

ADAM: dict[tuple[str, str], float | None] = {
    ("onebit_adam(identity)", "allreduce"): 0.25,
    ("onebit_adam(onebit:bucket_size=256)", "allgather"): 1.45,
    ("onebit_adam(topk:fraction=0.01)", "sparse"): 5.6,
    ("onebit_adam(threelc:sparsity=1.0)", "two_phase"): 3.87,
    ("onebit_adam(qsgd:bits=2,bucket_size=128)", "two_phase"): None,
    ("onebit_adam(qsgd:bits=2,bucket_size=128)", "allgather"): 0.28,
    ("cast:dtype=bfloat16", "two_phase"): -0.0,
    ("int8", "two_phase"): 0.06,
    ("qsgd:bits=4", "two_phase"): 3.47,
    ("qsgd:bits=2,bucket_size=128", "two_phase"): 26.42,
    ("natural", "two_phase"): 1.08,
    ("terngrad", "allgather"): 17.68,
    ("onebit", "allgather"): 6.3,
    ("signsgd", "allgather"): 9.71,
    ("threelc:sparsity=1.0", "two_phase"): 15.88,
    ("threelc:sparsity=1.5", "allgather"): 21.36,
    ("topk:fraction=0.01", "sparse"): 10.8,
    ("cast:dtype=bfloat16", "allgather"): -0.0,
    ("int8", "allgather"): 0.01,
    ("qsgd:bits=4", "allgather"): 1.53,
    ("qsgd:bits=2,bucket_size=128", "allgather"): 10.8,
    ("natural", "allgather"): 0.43,
    ("threelc:sparsity=1.0", "allgather"): 18.67,
    ("topk:fraction=0.01", "allgather"): 10.8,
}
