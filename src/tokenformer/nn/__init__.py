"""Pattention and its Θ variants, the fused autograd Function, the C++ Θ kernel and product-key
Pattention: the building blocks, importing torch only (docs/architecture.md)."""
