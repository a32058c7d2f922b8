#!/usr/bin/env bash
# Launch the TensorFlow digits examples on 2 local processes, both ways Horovod supports:
# Keras model.fit (examples/tensorflow_keras_digits.py) and a tf.function step with
# DistributedGradientTape and checkpoints (examples/tensorflow_tape_digits.py).
# Extra arguments go to both scripts, e.g.:
#   bash examples/run_tensorflow.sh --compressor topk --memory residual --communicator allgather \
#       --compress-ratio 0.01
# On several hosts: horovodrun -np 4 -H host1:2,host2:2 ...  /  mpirun -np 4 -H host1:2,host2:2 ...
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=3
ckpt=$(mktemp -d)
trap 'rm -rf "$ckpt"' EXIT

echo "== Keras model.fit, horovodrun (Gloo) =="
horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_keras_digits.py "$@"

echo "== DistributedGradientTape in tf.function, mpirun (Open MPI), 10 epochs with checkpoints =="
# yield_when_idle: with more ranks than cores, a rank waiting in MPI must not spin while its
# peer traces the tf.function (the first step takes minutes instead of seconds otherwise).
mpirun -np 2 --oversubscribe --bind-to none $( [ "$(id -u)" = 0 ] && echo --allow-run-as-root ) \
    --mca mpi_yield_when_idle 1 -x PATH -x OMP_NUM_THREADS -x TF_CPP_MIN_LOG_LEVEL \
    python examples/tensorflow_tape_digits.py --epochs 10 --ckpt-dir "$ckpt" "$@"

echo "== ... resumed from its checkpoint for 10 more epochs, horovodrun (Gloo) =="
horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_tape_digits.py \
    --epochs 20 --ckpt-dir "$ckpt" "$@"
