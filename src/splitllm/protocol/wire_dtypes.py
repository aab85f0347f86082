"""The dtypes hidden states may cross the wire in, by name.

Apart from the frames (`wire`), which map them to torch dtypes, so that the command line offers them
without importing torch.
"""

WIRE_DTYPE_NAMES = ("float32", "float16", "bfloat16")
