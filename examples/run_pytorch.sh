#!/usr/bin/env bash
# Launch examples/pytorch_digits.py on 2 local processes, both ways Horovod supports.
# Extra arguments go to the script, e.g.:
#   bash examples/run_pytorch.sh --compressor topk --memory residual --communicator allgather \
#       --compress-ratio 0.01
# On several hosts: horovodrun -np 4 -H host1:2,host2:2 ...  /  mpirun -np 4 -H host1:2,host2:2 ...
set -euo pipefail
cd "$(dirname "$0")/.."
# horovodrun imports TensorFlow to list the frameworks it was built with; keep its start-up
# notices quiet (no TF model runs here).
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=3 TF_ENABLE_ONEDNN_OPTS=0

echo "== horovodrun (Gloo) =="
horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py "$@"

echo "== mpirun (Open MPI) =="
mpirun -np 2 --oversubscribe --bind-to none $( [ "$(id -u)" = 0 ] && echo --allow-run-as-root ) \
    -x PATH -x OMP_NUM_THREADS python examples/pytorch_digits.py "$@"
