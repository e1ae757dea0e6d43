"""Microbenchmarks of the fused ops: `python -m kernels.bench [--quick]` (see __main__.py).

Results of the runs committed with the project are in kernels/bench/results/<device>.json and .png.
"""
