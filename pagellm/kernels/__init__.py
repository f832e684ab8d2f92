"""Attention kernels: pure-torch references (the CPU path) and, for CUDA, Triton.

Kernels know nothing about requests or schedulers: they take tensors and offsets.
"""
