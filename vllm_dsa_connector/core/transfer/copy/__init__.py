"""Local copies: gather, scatter, copy_runs, their widths and Triton kernels."""
