"""``signsgd``: signSGD with majority vote (Bernstein, Wang, Azizzadenesheli, Anandkumar 2018,
"signSGD: Compressed Optimisation for Non-Convex Problems"; Bernstein, Zhao, Azizzadenesheli,
Anandkumar 2019, "signSGD with Majority Vote is Communication Efficient and Fault Tolerant").

Each rank sends the sign of its gradient; the aggregate is the majority vote, the sign of the sum
of the ranks' signs (+1, -1, or 0 where the vote ties), and it is *not* divided by the number of
ranks (``average = False``).

Wire, for ``n`` elements: one uint8 tensor of ``ceil(n/8) + 1`` bytes, the packed signs (1 bit
per element, bit 1 = negative, zero counts as positive: see ``signbits``) followed by one status
byte that is 1 when the input held a NaN or an Inf. So 1 bit/element plus 8 bits per tensor; any
dtype in, the same bytes out. Decompression gives +-1 in the input's dtype, or NaN everywhere when
the status byte is set, so a NaN/Inf gradient is not silently turned into a vote.

Biased (it keeps only signs); not allreduce-safe (signs must be gathered, not summed, for the
vote); every rank sends the same size; two-phase safe: the vote is elementwise, so chunks vote
independently (the second phase re-sends the voted signs, the parameter-server scheme of the
paper; a tie then travels as +1).
"""

from __future__ import annotations

import math

from grace_dl.backend import ops_for
from grace_dl.compressors import signbits
from grace_dl.compressors.base import LOCAL, Compressor
from grace_dl.registry import register_compressor


@register_compressor("signsgd")
class SignSGDCompressor(Compressor):
    allreduce_safe = False
    equal_sizes = True
    average = False
    two_phase_safe = True
    unbiased = False

    def __init__(self):
        super().__init__()

    def compress(self, tensor, name, call=LOCAL):
        ops = ops_for(tensor)
        return self._encode(ops, ops.flatten(tensor)), (ops.shape(tensor), ops.dtype(tensor))

    @staticmethod
    def _encode(ops, flat):
        return [ops.cat([signbits.encode(ops, flat), signbits.status(ops, flat)])]

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        packed = payload[0]
        ops = ops_for(packed)
        nbytes = ops.numel(packed) - 1
        bits = ops.slice(packed, 0, nbytes)
        nan = signbits.nan_if(ops, ops.slice(packed, nbytes, nbytes + 1))
        n = math.prod(shape)
        table = ops.cat([nan + 1.0, nan - 1.0])
        return ops.reshape(signbits.decode(ops, bits, n, table, dtype), shape)

    def aggregate(self, tensors):
        """Majority vote: the sign of the sum of the ranks' +-1 (0 where the vote ties)."""
        return ops_for(tensors[0]).sign(super().aggregate(tensors))

    def payload_nbytes(self, numel, dtype="float32"):
        """``ceil(numel / 8)`` sign bytes + 1 status byte, whatever the input dtype."""
        return math.ceil(numel / 8) + 1
