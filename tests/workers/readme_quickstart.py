"""The README's Horovod (PyTorch) quickstart, as printed, on every rank: a model defined before
it, a short loop where it says "the usual loop"; reports the bytes grace moved and a checksum
of the parameters (tests/test_readme_quickstarts.py)."""

import sys

import torch

import mp

snippet = sys.argv[1]
head, _, tail = snippet.partition("# ... the usual loop")
tail = tail.split("\n", 1)[1].lstrip("#").split("\n", 1)[-1]    # the comment's second line
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
namespace = {"model": model}
exec(compile(head + tail, "README.md", "exec"), namespace)  # noqa: S102
hvd, opt, grc = namespace["hvd"], namespace["opt"], namespace["grc"]
g = torch.Generator().manual_seed(hvd.rank())
for _ in range(4):
    opt.zero_grad()
    model(torch.randn(16, 32, generator=g)).square().mean().backward()
    opt.step()
mp.report({"steps": grc.bytes.total["steps"], "sent": grc.bytes.total["sent"],
           "last": grc.bytes.steps[-1]["sent"],
           "checksum": float(sum(p.double().sum() for p in model.parameters()))},
          rank=hvd.rank())
