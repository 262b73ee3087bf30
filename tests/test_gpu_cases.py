"""tests/test_gpu.py's case lists build on every machine.

test_gpu.py skips at import where there is no CUDA GPU, before its lists
are built; an error there (a codec refusing a configuration the list asks
for) would first show on a GPU machine. Importing the lists here, in the
fast tier, fails CI instead.
"""

from __future__ import annotations

import gpu_cases

import jaxcomp
from jaxcomp.codecs import BucketedCodec, Rate


def test_every_kernel_codec_is_covered():
    covered = {type(c) for c in gpu_cases.CODECS}
    kernels = {c for c in jaxcomp.codecs.registered() if c.rate is not Rate.LINEAR}
    assert kernels <= covered, kernels - covered


def test_case_ids_are_unique():
    for cases in (
        gpu_cases.CODECS,
        gpu_cases.LARGEST_BUCKET,
        gpu_cases.GRID_STRIDE,
        gpu_cases.EMPTY_INPUT,
        gpu_cases.first_examples(),
        gpu_cases.decode_sum_codecs(),
    ):
        ids = [gpu_cases.codec_id(c) for c in cases]
        assert cases and len(set(ids)) == len(ids), ids


def test_unlisted_bucketed_codecs_get_small_and_looping_buckets():
    """Where a codec takes other bucket sizes, its smallest (8) and a looping
    one (4096) are cases; MX, which fixes its block, keeps its examples."""
    for c in gpu_cases.unlisted_codecs():
        if isinstance(c, BucketedCodec) and c.name != "mx":
            sizes = {d.bucket_size for d in gpu_cases.unlisted_codecs() if type(d) is type(c)}
            assert {8, 4096} <= sizes, (c, sizes)
