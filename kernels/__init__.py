"""qerl_kernels."""
