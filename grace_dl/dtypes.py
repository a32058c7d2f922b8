"""Bytes per element of the dtypes grace_dl moves, by the backend-neutral dtype name
(``ops.dtype(x)``): the one table the compressors' byte formulas, the communicators and the
strategy's cost model read."""

from __future__ import annotations

ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
            "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def itemsize(dtype: str) -> int:
    """Bytes of one ``dtype`` element; ``ValueError`` naming the known dtypes otherwise."""
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(ITEMSIZE)}") from None
