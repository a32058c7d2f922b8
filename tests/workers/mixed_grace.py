"""Rank 0 passes ``grace=``, rank 1 ``grace=None``: every rank must get a ValueError, not hang
(tests/test_faults.py). Usage: ``mixed_grace.py torch|tensorflow``. Each rank reports its error
(an uncaught one would let horovodrun kill the slower rank before it prints)."""

import sys

import mp
from grace_dl import grace_from_params

TOPK = {"compressor": "topk", "memory": "residual", "communicator": "allgather",
        "compress_ratio": 0.5}



def torch_job():
    import torch

    import grace_dl.torch.horovod as hvd

    hvd.init()
    model = torch.nn.Linear(4, 2)
    grc = grace_from_params(TOPK) if hvd.rank() == 0 else None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), grace=grc)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()


def tf_job():
    import tensorflow as tf

    import grace_dl.tensorflow.horovod as hvd

    hvd.init()
    w = tf.Variable(tf.ones((4,)), name="w")
    grc = grace_from_params(TOPK) if hvd.rank() == 0 else None
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        grads = hvd.DistributedGradientTape(tape, grace=grc).gradient(loss, [w])
        w.assign_sub(0.1 * grads[0])


try:
    (torch_job if sys.argv[1] == "torch" else tf_job)()
    mp.report("finished without an error")
except ValueError as err:
    mp.report(f"ValueError: {err}")
