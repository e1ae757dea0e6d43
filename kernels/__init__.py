"""Fused ops (Triton on GPU, C++ on CPU) with a torch reference as ground truth."""
