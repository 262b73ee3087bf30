"""The case lists of tests/test_gpu.py, importable without a GPU.

test_gpu.py skips at import where no CUDA GPU is visible, which would also
hide an error in building its lists; tests/test_gpu_cases.py imports this
module in the fast tier, so such an error fails on every machine.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jaxcomp
from jaxcomp.codecs import (
    QSGD,
    BucketedCodec,
    Cast,
    Codec,
    Int8,
    Natural,
    OneBit,
    Rate,
    TernGrad,
    ThreeLC,
    TopK,
)

# Bucket sizes cover one lane per bucket (8), several buckets per block
# (16..1024), one per block (2048) and lanes that loop (4096).
LISTED = [
    QSGD(bits=2, bucket_size=128),
    QSGD(bits=3, bucket_size=8, norm="l2"),
    QSGD(bits=4, bucket_size=512),
    QSGD(bits=4, bucket_size=64, norm="l2"),
    QSGD(bits=8, bucket_size=2048, norm="l2"),
    QSGD(bits=8, bucket_size=16),
    QSGD(bits=2, bucket_size=4096, norm="l2"),
    OneBit(),
    OneBit(bucket_size=8),
    OneBit(bucket_size=1024),
    Int8(),
    Int8(bucket_size=32),
    Cast("bfloat16"),
    Cast("float16"),
    TernGrad(),
    TernGrad(bucket_size=8),
    TernGrad(bucket_size=4096),
    Natural(),
    Natural(bucket_size=8),
    Natural(stochastic=False, bucket_size=16),
    Natural(stochastic=False, bucket_size=4096),
    ThreeLC(),
    ThreeLC(sparsity=1.75),
    ThreeLC(sparsity=1.5, capacity=64),
    TopK(fraction=0.01),
    TopK(fraction=1.0),
    TopK(k_per_bucket=(8, 512)),
    TopK(k_per_bucket=(100, 128)),
    TopK(fraction=0.05, value_codec=QSGD(bits=4)),
]


def _with_bucket(codec: Codec, bucket: int) -> Codec | None:
    """``codec`` with another bucket size, or None where the codec fixes it
    (MX: the specification's block of 32)."""
    try:
        return dataclasses.replace(codec, bucket_size=bucket)
    except ValueError:
        return None


def unlisted_codecs() -> list[Codec]:
    """Codecs of a registered class that LISTED does not name: their
    coverage examples and, for bucketed ones, the smallest and a looping
    bucket where the codec takes them. A new codec's CUDA kernels are tested
    without an edit here."""
    listed = {type(c) for c in LISTED}
    new = [
        c
        for cls in jaxcomp.codecs.registered()
        if cls not in listed and cls.rate is not Rate.LINEAR
        for c in cls.examples(coverage=True)
    ]
    more = [_with_bucket(c, b) for c in new if isinstance(c, BucketedCodec) for b in (8, 4096)]
    return list(dict.fromkeys(new + [c for c in more if c is not None]))


CODECS = LISTED + [c for c in unlisted_codecs() if c not in LISTED]
DTYPES = ["float32", "bfloat16", "float16"]
SIZES = [1, 7, 1000, 4099, 70001]

# The largest bucket: one bucket per block, each lane reducing 256 values
# before the shared-memory levels.
LARGEST_BUCKET = [
    QSGD(bits=4, bucket_size=65536, norm="l2"),
    QSGD(bits=8, bucket_size=65536),
    OneBit(bucket_size=65536),
    Int8(bucket_size=65536),
    TernGrad(bucket_size=65536),
    Natural(bucket_size=65536),
]

# More groups of 8 than the decode and cast grids have threads (8192 blocks
# of 256), so their grid-stride loops go round more than once.
GRID_STRIDE = [QSGD(), OneBit(), Int8(), Cast("bfloat16"), TernGrad(), Natural()]

EMPTY_INPUT = [
    QSGD(),
    OneBit(),
    Int8(),
    Cast("float16"),
    TernGrad(),
    Natural(stochastic=False),
    TopK(),
    TopK(k_per_bucket=(8, 512)),
]


def first_examples() -> list[Codec]:
    """Each registered codec's recommended configuration (and a nested
    TopK): the batched-call cases."""
    return [
        cls.examples()[0] for cls in jaxcomp.codecs.registered() if cls.rate is not Rate.LINEAR
    ] + [TopK(fraction=0.05, value_codec=QSGD(bits=4))]


def decode_sum_codecs() -> list[Codec]:
    """Every example of a codec with a decode-and-sum kernel (the CPU's; on a
    GPU "ffi" runs the CUDA one where ``cuda_decode_sum_kernel``, else the
    twin)."""
    return [
        c
        for cls in jaxcomp.codecs.registered()
        if "decode_sum" in cls.kernels.cpu
        for c in cls.examples()
    ]


def feedback_codecs() -> list[Codec]:
    """Every example of a codec with a fused error-feedback kernel (CPU)."""
    return [c for cls in jaxcomp.codecs.registered() for c in cls.examples() if c.feedback_kernel]


def codec_id(codec: Codec) -> str:
    """Short ids for the command line: qsgd-b4-B512-max, onebit-B64, cast-float16."""
    if isinstance(codec, QSGD):
        return f"qsgd-b{codec.bits}-B{codec.bucket_size}-{codec.norm}"
    if isinstance(codec, Cast):
        return f"cast-{codec.dtype}"
    if isinstance(codec, Natural):
        mode = "stoch" if codec.stochastic else "nearest"
        return f"natural-{mode}-B{codec.bucket_size}"
    if isinstance(codec, ThreeLC):
        return f"threelc-s{codec.sparsity}-cap{codec.capacity}"
    if isinstance(codec, TopK):
        mode = (
            f"f{codec.fraction}"
            if codec.fraction is not None
            else "k{}-B{}".format(*codec.k_per_bucket)
        )
        nested = f"-{codec_id(codec.value_codec)}" if codec.value_codec is not None else ""
        return f"topk-{mode}{nested}"
    extra = "".join(
        f"-{v}" for f in ("format", "element") if isinstance(v := getattr(codec, f, None), str)
    )
    if getattr(codec, "stochastic", False):
        extra += "-stoch"
    return f"{codec.name}{extra}-B{codec.bucket_size}"


def dtype_id(dtype) -> str:
    return np.dtype(dtype).name


def gpu_input(n: int, dtype, seed: int = 0) -> np.ndarray:
    """Normal values with an all-zero stretch (a zero-scale bucket where
    buckets are small) and some negative zeros."""
    rng = np.random.default_rng(seed * 1_000_003 + n)
    x = 3.0 * rng.standard_normal(n, dtype=np.float32)
    x[:40] = 0.0
    x[5::97] = -0.0
    return x.astype(dtype)
