"""`python -m splitllm.kernels`: compile every kernel variant this CPU runs into the package, once, at install."""

from splitllm.kernels import cpu_kernels

if __name__ == "__main__":
    built = cpu_kernels.build()
    print(f"splitllm CPU kernels built: {', '.join(built) or 'none (this CPU runs PyTorch kernels)'}")
