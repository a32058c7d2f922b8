"""Prints the rank (torchrun's ``RANK``) and the cores this process may run on."""

import os

print("CORES", os.environ["RANK"], ",".join(map(str, sorted(os.sched_getaffinity(0)))),
      flush=True)
