"""jaxcomp: compressed gradient communication for data-parallel JAX training."""

from jaxcomp import codecs, collectives, fsdp, launch, ops, optax, train, wire
from jaxcomp._ffi import cpu_available, cuda_available
from jaxcomp.collectives import Reduced, all_gather, pmean, psum, psum_scatter
from jaxcomp.errors import WireFormatError
from jaxcomp.payload import Payload
from jaxcomp.train import DataParallel, data_parallel

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "Payload",
    "Reduced",
    "WireFormatError",
    "all_gather",
    "codecs",
    "collectives",
    "cpu_available",
    "cuda_available",
    "data_parallel",
    "fsdp",
    "launch",
    "ops",
    "optax",
    "pmean",
    "psum",
    "psum_scatter",
    "train",
    "wire",
]
