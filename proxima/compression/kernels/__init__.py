"""Triton kernels of the compression ops, one op per module; `proxima.compression.triton_ops` is
their public face. Importing any of them imports triton."""
