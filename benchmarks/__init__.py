"""grace_dl benchmarks: micro (compressors.py) and end-to-end over an emulated network."""
