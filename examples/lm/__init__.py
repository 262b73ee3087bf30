"""A small byte-level transformer language model on the help text that ships
with Python (``pydoc_data.topics``), data parallel over 8 simulated devices,
with the gradient all-reduce compressed by a jaxcomp codec."""
