"""``tvm-fusion``: benchmark, show, build (and tune) from the command line.

Bad input (unknown op, malformed shape, unknown target or dtype) prints one line
and exits with status 2, like argparse's own usage errors; no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from . import OPS

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad command-line value: reported in one line, exit status 2."""


def parse_shape(text: str) -> tuple[int, ...]:
    """``64x256x56x56`` or ``64,256,56,56`` -> (64, 256, 56, 56)."""
    parts = text.replace(",", "x").split("x")
    try:
        dims = tuple(int(p) for p in parts if p != "")
    except ValueError:
        raise UsageError(f"malformed shape {text!r}: expected sizes like 64x256x56x56") from None
    if not dims or any(d <= 0 for d in dims):
        raise UsageError(f"malformed shape {text!r}: expected positive sizes like 64x256x56x56")
    return dims


def parse_ops(text: str) -> list[str]:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    for op in ops:
        if op not in OPS:
            raise UsageError(f"unknown op {op!r}: choose from {', '.join(OPS)}")
    return ops


def parse_target(text: str) -> Any:
    from . import targets

    if text.startswith("{"):
        import json

        try:
            text = json.loads(text)
        except json.JSONDecodeError as err:
            raise UsageError(f"target {text!r} is not valid JSON: {err.msg}") from None
    try:
        return targets.resolve(text)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


DTYPES = ("float16", "bfloat16", "float32")


def parse_dtype(text: str) -> str:
    if text not in DTYPES:
        raise UsageError(f"unknown dtype {text!r}: choose from {', '.join(DTYPES)}")
    return text


def _options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if getattr(args, "layout", None):
        opts["layout"] = args.layout
    for name in ("reduction", "label_smoothing", "ignore_index"):
        value = getattr(args, name, None)
        if value is not None:
            opts[name] = value
    return opts


def _problem(op: str, shape: tuple[int, ...], dtype: str, args: argparse.Namespace):
    from .api import make_problem

    options = _options(args)
    if op == "bn_stats":
        options = {k: v for k, v in options.items() if k == "layout"}
    else:
        options.pop("layout", None)
    try:
        return make_problem(op, shape, dtype, **options)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


# -- commands --------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    cases = None
    if args.shapes:
        ops = parse_ops(args.ops)
        if len(ops) != 1:
            raise UsageError("--shapes needs exactly one op in --ops")
        dtype = parse_dtype(args.dtype or "float16")
        cases = [bench.Case(ops[0], parse_shape(s), dtype, tuple(sorted(_options(args).items()))) for s in args.shapes]
        for case in cases:
            _problem(case.op, case.shape, case.dtype, args)
    elif args.ops != ",".join(OPS) or args.dtype:
        on_gpu = bench.gpu_available() if args.device is None else args.device == "cuda"
        defaults = bench.GPU_CASES if on_gpu else bench.CPU_CASES
        ops = parse_ops(args.ops)
        cases = [c for c in defaults if c.op in ops]
        if args.dtype:
            cases = [bench.Case(c.op, c.shape, parse_dtype(args.dtype), c.options) for c in cases]
    csv_path = None if args.no_record else os.path.join(args.results, bench.CSV_NAME)
    providers = set(args.providers.split(",")) if args.providers else None
    bench.run(cases, device=args.device, csv_path=csv_path, plots=None if args.no_record else args.results,
              providers=providers)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from . import registry
    from .compute import prim_func
    from .dispatch import choose
    from .kernel import schedule_for

    op = parse_ops(args.op)[0]
    target = parse_target(args.target)
    problem = _problem(op, parse_shape(args.shape), parse_dtype(args.dtype), args)
    choice = choose(problem, target)
    name = args.candidate or choice.candidate
    try:
        cand = registry.get(name)
    except KeyError as err:
        raise UsageError(str(err).strip("'\"")) from None
    section = lambda title: print(f"\n==== {title} " + "=" * max(0, 60 - len(title)))  # noqa: E731
    section("contract")
    print(problem.describe())
    section(f"TE compute ({cand.algorithm})")
    print(prim_func(problem, cand.algorithm).script())
    section("dispatch")
    print(f"{choice.candidate} [{choice.knobs}] ({choice.source}): {choice.reason}")
    sch, knobs = schedule_for(problem, target, name)
    section(f"scheduled TIR: {name} [{knobs}]")
    print(sch.mod.script())
    section("trace")
    print(sch.trace)
    from .kernel import build_kernel

    kernel = build_kernel(problem, target, name, knobs)
    section("CUDA source" if target.kind.name == "cuda" else "LLVM IR")
    print(kernel.device_source())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tvm-fusion",
        description="Fused reduction kernels (bn_stats, cross_entropy) on Apache TVM: "
        "benchmark, inspect, tune and build.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add_problem_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--layout", choices=["NCHW", "NHWC"], help="bn_stats layout (default NCHW)")
        p.add_argument("--reduction", choices=["none", "mean", "sum"], help="cross_entropy reduction")
        p.add_argument("--label-smoothing", dest="label_smoothing", type=float, help="cross_entropy label smoothing")
        p.add_argument("--ignore-index", dest="ignore_index", type=int, help="cross_entropy ignore_index")

    bench = sub.add_parser("bench", help="time every candidate, the default pick and the peers")
    bench.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: both)")
    bench.add_argument("--shapes", nargs="+", help="shapes like 4096x32000 (default: DESIGN.md's table on a GPU)")
    bench.add_argument("--dtype", help="input dtype for --shapes (default float16)")
    bench.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when torch sees a GPU")
    bench.add_argument("--providers", help="comma-separated subset, e.g. 'tvm_fusion,torch eager'")
    bench.add_argument("--results", default="results", help="folder of the CSV and the PNGs")
    bench.add_argument("--no-record", action="store_true", help="print only: no CSV rows, no PNGs")
    add_problem_options(bench)
    bench.set_defaults(func=cmd_bench)

    show = sub.add_parser("show", help="print contract, TE compute, scheduled TIR, trace and source")
    show.add_argument("op", help="bn_stats or cross_entropy")
    show.add_argument("shape", help="e.g. 64x256x56x56")
    show.add_argument("--dtype", default="float16")
    show.add_argument("--target", default="cuda", help="cuda, llvm or a JSON target dict")
    show.add_argument("--candidate", help="a candidate name (default: the dispatch pick)")
    add_problem_options(show)
    show.set_defaults(func=cmd_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as err:
        print(f"tvm-fusion {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `tvm-fusion show ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
