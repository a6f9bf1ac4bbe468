"""Streaming analysis of torch-profiler chrome traces (`*.pt.trace.json[.gz]`): `events` reads a
trace one event at a time (never loaded whole, so a profile of hundreds of MB costs memory in
proportion to one read chunk plus a bounded reorder window, not to the file), `kernels` files a
GPU kernel under a category, `summary` sums GPU time by category, busy time as the union over
streams, launch gaps and top kernels, `trim` writes a small trace of the GPU events.
"""
