"""A small CNN on scikit-learn's 8x8 digits, data parallel over 8 simulated
devices, with the gradient all-reduce compressed by a jaxcomp codec."""
