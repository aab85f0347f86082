"""splitllm's C++ CPU kernels (`csrc/`) and their loader."""
