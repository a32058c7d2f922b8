"""The variables a strategy is built for, named as the training glue names their gradients.

``variables_of`` accepts

* ``model.named_parameters()`` (torch): ``(name, parameter)`` pairs, names as the torch
  ``DistributedOptimizer`` uses them;
* TF / Keras variables (``model.trainable_variables``): a Keras 3 variable by its ``path``
  (``"sequential/dense/kernel"``), a ``tf.Variable`` by its name without ``":0"``; repeated
  names get ``"_1"``, ``"_2"``, ... in order, exactly as ``grace_dl.tensorflow.gradients`` does;
* a dict ``name -> shape`` (or ``name -> array``), or ``(name, shape)`` pairs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class Variable:
    name: str
    shape: tuple
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _dtype_name(dtype) -> str:
    if dtype is None:
        return "float32"
    name = getattr(dtype, "name", None)
    if isinstance(name, str):  # numpy / tensorflow dtypes
        return name
    return str(dtype).replace("torch.", "")


def _is_dim(d) -> bool:
    """An integer dimension (NumPy's too; not ``True``, not ``1.5``)."""
    return isinstance(d, numbers.Integral) and not isinstance(d, bool) or \
        type(d).__name__ == "Dimension" and d.value is not None


def _shape(value, name: str) -> tuple:
    shape = getattr(value, "shape", value)
    if isinstance(shape, int):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(_is_dim(d) for d in dims):
        raise ValueError(f"variable {name!r}: shape must be a sequence of ints or a tensor, "
                         f"got {value!r}") from None
    dims = tuple(int(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"variable {name!r}: negative dimension in shape {dims}")
    return dims


def _tf_name(var) -> str | None:
    path = getattr(var, "path", None)
    if isinstance(path, str) and path:
        return path
    name = getattr(var, "name", None)
    if isinstance(name, str) and name:
        return name[:-2] if name.endswith(":0") else name
    return None


def variables_of(named_parameters_or_shapes) -> list[Variable]:
    """Normalise the accepted inputs to a list of ``Variable`` (order kept)."""
    source = named_parameters_or_shapes
    if isinstance(source, dict):
        items = list(source.items())
    else:
        try:
            items = list(source)
        except TypeError:
            raise ValueError(f"expected named parameters, variables or a dict name -> shape, "
                             f"got {type(source).__name__}") from None
    out: list[Variable] = []
    used: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, value = item
            shape = _shape(value, name)
            dtype = getattr(value, "dtype", None)
        else:
            base = _tf_name(item)
            if base is None or not hasattr(item, "shape"):
                raise ValueError(f"item {i} ({type(item).__name__}) is neither a (name, tensor) "
                                 f"pair nor a named variable")
            name, k = base, 0
            while name in used:
                k += 1
                name = f"{base}_{k}"
            shape, dtype = _shape(item, name), getattr(item, "dtype", None)
        if name in used:
            raise ValueError(f"variable name {name!r} appears twice")
        used.add(name)
        out.append(Variable(name, shape, _dtype_name(dtype)))
    if not out:
        raise ValueError("no variables given to build a strategy for")
    return out


def device_of(source):
    """Where the tensors of ``source`` (as ``variables_of`` takes it) live: the device of the
    first that says (a torch tensor's ``device``, a TF variable's device string), ``None``
    when none does (shapes)."""
    items = source.values() if isinstance(source, dict) else source
    if not isinstance(items, (list, tuple, type({}.values()))):
        return None     # an iterator: reading it here would leave nothing to build from
    for item in items:
        value = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        device = getattr(value, "device", None)
        if device:
            return device
    return None


def bucket_layout(variables, bucket_bytes: int) -> list[list[int]]:
    """Positions of ``variables`` (forward order) in the buckets ``DistributedOptimizer(
    bucket_bytes=...)`` packs them into (``grace_dl.communicators.buckets``): buckets in the
    order they fill in the backward pass, each bucket's members in that order too."""
    from grace_dl.communicators.buckets import pack
    from grace_dl.dtypes import itemsize

    variables = list(variables)
    ready = list(range(len(variables)))[::-1]
    layout = pack([((variables[i].dtype, ""), variables[i].numel * itemsize(variables[i].dtype))
                   for i in ready], bucket_bytes)
    return [[ready[j] for j in members] for members in layout]


def bucketed(variables, bucket_bytes: int) -> list[Variable]:
    """``variables`` as the buckets ``DistributedOptimizer(bucket_bytes=...)`` sends them: one
    flat variable per bucket, named like the bucket, in forward order, so that a bucket becomes
    ready, in a step model's reverse pass, when its last member does."""
    from grace_dl.communicators.buckets import bucket_name

    variables = list(variables)
    buckets = [Variable(bucket_name([variables[i].name for i in members]),
                        (sum(variables[i].numel for i in members),), variables[members[0]].dtype)
               for members in bucket_layout(variables, bucket_bytes)]
    return buckets[::-1]
