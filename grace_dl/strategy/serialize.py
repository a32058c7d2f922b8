"""Reading and writing strategies: protobuf text format and binary wire format.

Files ending in ``.pbtxt``, ``.textproto``, ``.txt`` or ``.prototxt`` are text; ``.pb``,
``.bin`` and ``.binpb`` are binary; any other suffix is tried as text, then as binary.
Binary output is deterministic (map entries sorted), so equal strategies give equal bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

from google.protobuf import text_format
from google.protobuf.message import DecodeError

from grace_dl.strategy import strategy_pb2 as pb

TEXT_SUFFIXES = (".pbtxt", ".textproto", ".txt", ".prototxt")
BINARY_SUFFIXES = (".pb", ".bin", ".binpb")


def to_text(strategy) -> str:
    return text_format.MessageToString(strategy)


def from_text(text: str):
    strategy = pb.Strategy()
    try:
        text_format.Parse(text, strategy)
    except text_format.ParseError as err:
        raise ValueError(f"not a strategy in protobuf text format: {err}") from None
    return strategy


def to_bytes(strategy) -> bytes:
    return strategy.SerializeToString(deterministic=True)


def from_bytes(data: bytes):
    strategy = pb.Strategy()
    try:
        strategy.ParseFromString(bytes(data))
    except DecodeError as err:
        raise ValueError(f"not a serialized strategy: {err}") from None
    return strategy


def save(strategy, path, binary: bool | None = None) -> Path:
    """Write ``strategy`` to ``path`` (format from the suffix unless ``binary`` says) and record
    the path in its ``path`` field."""
    path = Path(path)
    if binary is None:
        binary = path.suffix in BINARY_SUFFIXES
    strategy.path = str(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if binary:
        tmp.write_bytes(to_bytes(strategy))
    else:
        tmp.write_text(to_text(strategy))
    tmp.replace(path)
    return path


def load(path):
    """Read a strategy file; ``ValueError`` if it is neither format."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"strategy file {str(path)!r} does not exist")
    data = path.read_bytes()
    if path.suffix in BINARY_SUFFIXES:
        strategy = from_bytes(data)
    elif path.suffix in TEXT_SUFFIXES:
        strategy = from_text(_decode(data, path))
    else:
        try:
            strategy = from_text(_decode(data, path))
        except ValueError:
            strategy = from_bytes(data)
    strategy.path = str(path)
    return strategy


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"strategy file {str(path)!r} is not text; binary strategies end in "
                         f"{', '.join(BINARY_SUFFIXES)}") from None


def coerce(strategy_or_path):
    """A ``Strategy`` message from a message, a path (str or ``Path``) or serialized bytes."""
    if isinstance(strategy_or_path, pb.Strategy):
        return strategy_or_path
    if isinstance(strategy_or_path, (bytes, bytearray, memoryview)):
        return from_bytes(bytes(strategy_or_path))
    if isinstance(strategy_or_path, (str, os.PathLike)):
        return load(strategy_or_path)
    raise ValueError(f"expected a Strategy message, a path to one or its bytes, got "
                     f"{type(strategy_or_path).__name__}")
