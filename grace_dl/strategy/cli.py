"""``python -m grace_dl strategy build|show|validate|measure`` (also ``grace-dl strategy ...``).

    build    --variables shapes.yaml | --model pkg.module:factory
             --builder allreduce|uniform|size-threshold|ps|auto  [--params '{...}']
             [--chunk-size N] [--spec AUTO|NCCL|RING] [--min-elements N] [--destination R]
             [--candidates '[{...}, ...]'] [--throughput file.json] [--device cpu|cuda]
             [--resource-spec cluster.yaml] -o strategy.pbtxt|strategy.pb
    show     strategy-file [--text] [--measured SECONDS|run.json]  (Auto's predicted step
             time next to the measured one)
    validate strategy-file [--variables ... | --model ...] [--workers N]
    measure  [--candidates '[{...}, ...]'] [--sizes 4096,262144] [--repeats 5] -o tp.json
             under horovodrun/mpirun also the job's collectives and pipelines
             (grace_dl.strategy.calibrate) unless --no-job; [--mbit M] is recorded

``--variables`` is a YAML/JSON mapping ``name: [d0, d1, ...]``; ``--model`` names a function
returning a torch module (its ``named_parameters()``) or a Keras model (its
``trainable_variables``). ``--params``/``--candidates`` are JSON with GRACE's keys. ``validate``
builds every pipeline the strategy names (as each rank will) and checks it against the model and
the number of workers; it exits 1 with the reasons when something is wrong.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from grace_dl.communicators.buckets import DEFAULT_BUCKET_BYTES

BUILDERS = ("allreduce", "uniform", "size-threshold", "ps", "auto")


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} is not valid JSON ({err}): {text!r}") from None


def _variables(args):
    if getattr(args, "variables", None):
        import yaml

        path = Path(args.variables)
        if not path.is_file():
            raise ValueError(f"variables file {args.variables!r} does not exist")
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{args.variables!r} must map variable names to shapes")
        return {str(k): tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    if getattr(args, "model", None):
        module, _, attr = args.model.partition(":")
        if not attr:
            raise ValueError(f"--model must look like package.module:function, got {args.model!r}")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except ImportError as err:
            raise ValueError(f"--model {args.model!r}: cannot import {module!r} ({err})") \
                from None
        except AttributeError:
            raise ValueError(f"--model {args.model!r}: module {module!r} has no {attr!r}") \
                from None
        if not callable(factory):
            raise ValueError(f"--model {args.model!r} is a {type(factory).__name__}, not a "
                             f"function returning a model")
        model = factory()
        if hasattr(model, "named_parameters"):
            return list(model.named_parameters())
        if hasattr(model, "trainable_variables"):
            return list(model.trainable_variables)
        raise ValueError(f"--model {args.model!r} returned a {type(model).__name__}, not a torch "
                         f"module (named_parameters) or a Keras model (trainable_variables)")
    return None


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _builder(args):
    from grace_dl.strategy import builders

    params = _json(args.params, "--params") if args.params else {}
    if args.builder == "allreduce":
        return builders.AllReduce(chunk_size=args.chunk_size or 128, spec=args.spec, **params)
    if args.builder == "uniform":
        return builders.Uniform(params, chunk_size=args.chunk_size or 1, spec=args.spec)
    if args.builder == "size-threshold":
        if args.min_elements is None:
            raise ValueError("--builder size-threshold needs --min-elements")
        return builders.SizeThreshold(args.min_elements, params, chunk_size=args.chunk_size or 1,
                                      spec=args.spec)
    if args.builder == "ps":
        return builders.PS(args.destination, params)
    candidates = (_json(args.candidates, "--candidates") if args.candidates
                  else builders.DEFAULT_CANDIDATES)
    return builders.Auto(candidates, chunk_size=args.chunk_size or 1, spec=args.spec,
                         throughput=args.throughput, device=args.device,
                         bucket_bytes=None if args.bucket_bytes == 0 else args.bucket_bytes)


def _check_output(path) -> None:
    """Fail before the work, not after it, when ``-o`` cannot be written."""
    if path and not Path(path).resolve().parent.is_dir():
        raise ValueError(f"-o {path!r}: directory {str(Path(path).parent)!r} does not exist")


def cmd_build(args) -> int:
    from grace_dl.strategy.serialize import save, to_text

    _check_output(args.output)
    variables = _variables(args)
    if variables is None:
        raise ValueError("build needs --variables or --model")
    builder = _builder(args)
    if args.builder == "auto" and not args.resource_spec:
        raise ValueError("--builder auto needs --resource-spec FILE: a YAML of the job's "
                         "workers, bandwidth and latency (examples/strategy_cluster.yaml)")
    strategy = builder.build(variables, args.resource_spec)
    if args.output:
        save(strategy, args.output)
        print(f"wrote {args.output}: {len(strategy.node_config)} nodes")
    else:
        sys.stdout.write(to_text(strategy))
    return 0


def _rows(dispatcher):
    from grace_dl.strategy.dispatcher import SPEC_NAMES

    rows = []
    for node in dispatcher.strategy.node_config:
        r = dispatcher.node(node.var_name)
        numel = 1
        for d in r.shape:
            numel *= d
        sync = "PS@" + str(r.root) if r.root is not None else f"AllReduce {r.group}" + (
            " bucket" if any(r.name in members for members in dispatcher.buckets) else "")
        rows.append((r.name, "x".join(map(str, r.shape)) or "?", str(numel if r.shape else "?"),
                     sync, SPEC_NAMES.get(r.spec, str(r.spec)), r.pipeline.label()))
    return rows


def cmd_show(args) -> int:
    from grace_dl.strategy.dispatcher import StrategyDispatcher
    from grace_dl.strategy.serialize import load, to_text

    strategy = load(args.strategy)
    if args.text:
        sys.stdout.write(to_text(strategy))
        return 0
    dispatcher = StrategyDispatcher(strategy)
    header = ("variable", "shape", "numel", "synchronizer", "spec", "pipeline")
    rows = [header] + _rows(dispatcher)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"strategy {strategy.id or '(no id)'} version {strategy.version}: {len(rows) - 1} "
          f"variables, {len(dispatcher.state_dict())} pipelines, replicas "
          f"{len(strategy.graph_config.replicas) or 'unspecified'}; fingerprint "
          f"{dispatcher.fingerprint()}")
    measured = _measured_step(args.measured) if args.measured else None
    if strategy.predicted_step_s:
        line = f"predicted step {strategy.predicted_step_s * 1e3:.1f} ms"
        if measured:
            line += (f", measured {measured * 1e3:.1f} ms (predicted / measured "
                     f"{strategy.predicted_step_s / measured:.2f})")
        print(line)
    elif measured:
        print(f"measured step {measured * 1e3:.1f} ms; the strategy holds no prediction "
              f"(only Auto predicts)")
    return 0


def _measured_step(value: str) -> float:
    """Seconds per step: a number, or a JSON file with ``step_s`` (an e2e record)."""
    try:
        seconds = float(value)
    except ValueError:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--measured {value!r} is neither seconds nor a JSON file") \
                from None
        record = _json(path.read_text(), f"--measured {value!r}")
        seconds = record.get("step_s") if isinstance(record, dict) else None
        if not isinstance(seconds, (int, float)):
            raise ValueError(f"--measured {value!r} has no numeric \"step_s\"") from None
    if not seconds > 0:
        raise ValueError(f"--measured must be a positive step time in seconds, got {value!r}")
    return float(seconds)


def cmd_validate(args) -> int:
    from grace_dl.strategy.dispatcher import StrategyDispatcher
    from grace_dl.strategy.serialize import load

    strategy = load(args.strategy)
    dispatcher = StrategyDispatcher(strategy, variables=_variables(args))
    replicas = len(strategy.graph_config.replicas)
    if args.workers is not None:
        if replicas and replicas != args.workers:
            raise ValueError(f"the strategy lists {replicas} replicas, not {args.workers} workers")
        roots = [r.root for r in map(dispatcher.node, (n.var_name for n in
                                                        strategy.node_config))
                 if r.root is not None and r.root >= args.workers]
        if roots:
            raise ValueError(f"PS reduction_destination rank(s) {sorted(set(roots))} do not exist "
                             f"among {args.workers} workers")
    print(f"ok: {len(strategy.node_config)} variables, {len(dispatcher.state_dict())} pipelines, "
          f"fingerprint {dispatcher.fingerprint()}")
    return 0


def cmd_measure(args) -> int:
    from grace_dl.strategy import builders, measure

    candidates = (_json(args.candidates, "--candidates") if args.candidates
                  else builders.DEFAULT_CANDIDATES)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        raise ValueError(f"--sizes must be two comma-separated integers, got {args.sizes!r}")\
            from None
    if len(sizes) != 2:
        raise ValueError(f"--sizes must be two comma-separated integers, got {args.sizes!r}")
    _check_output(args.output)
    document = measure.measure(candidates, sizes, args.repeats, args.framework,
                               job=False if args.no_job else None, mbit=args.mbit)
    if "job" in document and _rank() != 0:
        return 0  # rank 0 writes the job's measurement
    if args.output:
        measure.write(document, args.output)
        print(f"wrote {args.output}: {len(document['entries'])} compressors")
    else:
        print(json.dumps(document, indent=2))
    return 0


def _rank() -> int:
    import horovod.torch as hvd

    return hvd.rank()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grace-dl strategy",
                                description="Build, show and validate grace_dl strategies.")
    sub = p.add_subparsers(dest="command", required=True)

    def model_args(q):
        src = q.add_mutually_exclusive_group()
        src.add_argument("--variables", help="YAML/JSON mapping variable name -> shape")
        src.add_argument("--model", help="package.module:function returning a model")

    b = sub.add_parser("build", help="build a strategy for a model")
    model_args(b)
    b.add_argument("--builder", choices=BUILDERS, default="uniform")
    b.add_argument("--params", help="JSON object of GRACE keys (compressor, memory, ...)")
    b.add_argument("--chunk-size", type=_positive_int, help="variables per fusion group")
    b.add_argument("--spec", default="AUTO", help="AUTO, NCCL or RING")
    b.add_argument("--min-elements", type=int, help="size-threshold: smallest compressed tensor")
    b.add_argument("--destination", type=int, default=0, help="ps: the reducing rank")
    b.add_argument("--candidates", help="auto: JSON list of GRACE key objects")
    b.add_argument("--throughput", help="auto: measured compression throughput JSON")
    b.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="auto: where the job's gradients live (cuda: the GPU's compression "
                        "costs); default: the model's parameters' device, else cpu")
    b.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES,
                   help="auto: also price candidates with the variables in buckets of this "
                        "size (default 25 MiB, DDP's); 0: never bucket")
    b.add_argument("--resource-spec", help="YAML resource spec (AutoDist's format; "
                   "examples/strategy_cluster.yaml), needed by --builder auto")
    b.add_argument("-o", "--output", help="output file (.pbtxt text, .pb binary); else stdout")
    b.set_defaults(func=cmd_build)

    s = sub.add_parser("show", help="print a strategy as a table (or as text)")
    s.add_argument("strategy")
    s.add_argument("--text", action="store_true", help="protobuf text format instead")
    s.add_argument("--measured", help="measured step time after a run: seconds, or a JSON "
                                      "file with step_s; printed next to Auto's prediction")
    s.set_defaults(func=cmd_show)

    v = sub.add_parser("validate", help="check a strategy (and against a model)")
    v.add_argument("strategy")
    model_args(v)
    v.add_argument("--workers", type=_positive_int,
                   help="number of Horovod ranks it will run on")
    v.set_defaults(func=cmd_validate)

    m = sub.add_parser("measure", help="measure compression cost for Auto's cost model")
    m.add_argument("--candidates", help="JSON list of GRACE key objects (default: Auto's)")
    m.add_argument("--sizes", default="4096,262144", help="two tensor sizes to fit a line")
    m.add_argument("--repeats", type=_positive_int, default=5)
    m.add_argument("--framework", choices=("torch", "tensorflow"), default="torch")
    m.add_argument("--no-job", action="store_true",
                   help="under horovodrun/mpirun, skip timing the job's collectives and "
                        "pipelines")
    m.add_argument("--mbit", type=float, help="link speed to record with the job's timings")
    m.add_argument("-o", "--output", help="JSON file to write; else stdout")
    m.set_defaults(func=cmd_measure)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # an output file that cannot be written, an unreadable input
        print(f"error: {err.strerror or err}: {err.filename or ''}".rstrip(": "),
              file=sys.stderr)
        return 1
