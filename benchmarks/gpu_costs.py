"""The GPU's compression costs for ``Auto``, from the committed GPU compressor table.

    python -m benchmarks.gpu_costs --write    # grace_dl/strategy/gpu_throughput.json
    python -m benchmarks.gpu_costs --check    # exit 1 unless it is the conversion

``benchmarks/gpu.py compressors`` times each method's compress and decompress on a GPU at two
sizes (16M and 64M fp32 elements, ms per call in blocks of back-to-back calls); this writes
them in the throughput format ``Auto``'s cost model reads (``grace_dl.strategy.cost_model``):
per method, the line through the two sizes, as ``grace_dl.strategy.measure`` fits the two
sizes it times on a CPU (``measure.line``). The file ships in the package, and ``Auto`` uses
it when the job's tensors are on a GPU (``grace_dl.strategy.step_model.calibration_for``).

Entries match any parameters (``"params": {}``): a method's cost on a GPU hardly depends on
them (a top-k at 1% and at 10% select with the same kernel); ``measured_with`` says what they
were. ``none`` is left out: its compress is a reshape, free as the cost model has it (what
the table timed for it is the timer's floor). Sizes below 16M are the line extended: no small
tensor was timed, so a small call's fixed cost (a kernel launch, the host's issue) is the
line's intercept, which for a method whose 64M call was not slower than its 16M one is the
whole 16M call.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks import records
from grace_dl.strategy.cost_model import FORMAT, GPU_THROUGHPUT
from grace_dl.strategy.measure import line

SOURCE = records.RESULTS / "gpu_compressors.json"


def throughput_document(doc: dict) -> dict:
    """The throughput document of ``doc``'s (``gpu_compressors.json``) last run."""
    from benchmarks.gpu import PARAMS

    run = doc["runs"][-1]
    by_method: dict[str, dict[int, dict]] = {}
    for r in run["records"]:
        if "error" not in r and r["method"] != "none":
            by_method.setdefault(r["method"], {})[r["numel"]] = r
    entries = []
    for method, sizes in by_method.items():
        if len(sizes) < 2:
            continue
        small, large = sorted(sizes)[:1] + sorted(sizes)[-1:]
        entry = {"compressor": method, "params": {},
                 "measured_with": PARAMS.get(method, {}), "path": sizes[large]["path"]}
        for what in ("compress", "decompress"):
            entry[what] = line(small, sizes[small][f"{what}_ms"] / 1e3,
                               large, sizes[large][f"{what}_ms"] / 1e3)
        entries.append(entry)
    sizes = sorted({n for s in by_method.values() for n in s})
    return {"format": FORMAT,
            "device": f"cuda ({run['machine'].split(';')[0].strip()})",
            "source": f"benchmarks/results/gpu_compressors.json, run {run['id']} (commit "
                      f"{run['commit']}, {run['when']} UTC), by python -m benchmarks.gpu_costs",
            "sizes": [sizes[0], sizes[-1]] if sizes else [], "entries": entries}


def render(source=SOURCE) -> str:
    return json.dumps(throughput_document(records.load(source)), indent=1) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true", help=f"write {GPU_THROUGHPUT.name}")
    where.add_argument("--check", action="store_true",
                       help=f"exit 1 unless {GPU_THROUGHPUT.name} is the conversion")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        return records.up_to_date(GPU_THROUGHPUT, text, f"the conversion of {SOURCE.name}",
                                  "python -m benchmarks.gpu_costs --write")
    if args.write:
        GPU_THROUGHPUT.write_text(text)
        print(f"wrote {GPU_THROUGHPUT}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
