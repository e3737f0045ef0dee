"""Triton kernels of the GPU executor: paged attention read through block tables, the KV write, and the
batch-invariant matmul and RMSNorm. Each kernel has a torch reference it is tested against; on a machine
without a GPU the tests run them in Triton's interpreter (`TRITON_INTERPRET=1`, set by `tests/conftest.py`).

Importing a module here imports Triton; the executor does so only when it runs the kernel path.
"""
