"""A student MLP learning a fixed random teacher network's labels from an
endless stream of Gaussian inputs, data parallel over 8 simulated devices,
with the gradient all-reduce compressed by a jaxcomp codec; evaluated on a
large fixed held-out set (the accuracy-parity study's task)."""
