"""jaxcomp: compressed gradient communication for data-parallel JAX training."""

from jaxcomp import codecs, ops, wire
from jaxcomp._ffi import cpu_available, cuda_available
from jaxcomp.errors import WireFormatError
from jaxcomp.payload import Payload

__version__ = "0.1.0"

__all__ = [
    "Payload",
    "WireFormatError",
    "codecs",
    "cpu_available",
    "cuda_available",
    "ops",
    "wire",
]
