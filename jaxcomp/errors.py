"""Exceptions raised by jaxcomp."""


class WireFormatError(ValueError):
    """A byte stream is not a valid jaxcomp payload (malformed, truncated,
    inconsistent, or of an unknown version/codec)."""
