"""Exact attention over one CP group: Ulysses, ring and 2-D Ulysses x ring, with their kernels and sharding."""
