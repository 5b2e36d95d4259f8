"""``tvm-fusion``: benchmark, show, build, tune and train the cost model from the command line.

Bad input (unknown op, malformed shape, unknown target or dtype) prints one line
and exits with status 2, like argparse's own usage errors; no traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any

from . import OPS
from .api import KERNEL_OPS

EXIT_USAGE = 2


DEBUG_ENV = "TVM_FUSION_DEBUG"  # set: an error raises with its traceback instead of one line


class UsageError(Exception):
    """A bad command-line value: reported in one line, exit status 2."""


def parse_shape(text: str) -> tuple[int, ...]:
    """``64x256x56x56`` or ``64,256,56,56`` -> (64, 256, 56, 56)."""
    if not re.fullmatch(r"[0-9]+([x,][0-9]+)*", text):  # int() alone took "64xx3", "1_0" and " 4"
        raise UsageError(f"malformed shape {text!r}: expected sizes like 64x256x56x56")
    dims = tuple(int(p) for p in re.split(r"[x,]", text))
    if any(d <= 0 for d in dims):
        raise UsageError(f"malformed shape {text!r}: expected positive sizes like 64x256x56x56")
    return dims


def parse_ops(text: str, allowed: tuple[str, ...] = KERNEL_OPS) -> list[str]:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    for op in ops:
        if op not in allowed:
            raise UsageError(f"unknown op {op!r}: choose from {', '.join(allowed)}")
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
    for name in ("reduction", "label_smoothing", "ignore_index", "mode"):
        value = getattr(args, name, None)
        if value is not None:
            opts[name] = value
    return opts


def _op_options(op: str, options: dict) -> dict:
    """The command line's problem options that ``op`` takes (--layout is BatchNorm's,
    --mode the gradient's; the others cross entropy's)."""
    if op in ("bn_stats", "bn_backward", "bn_backward_dx", "bn_forward"):
        return {k: v for k, v in options.items() if k == "layout"}
    return {k: v for k, v in options.items() if k != "layout" and (k != "mode" or op == "cross_entropy_grad")}


def _problem(op: str, shape: tuple[int, ...], dtype: str, args: argparse.Namespace):
    from .api import make_problem

    try:
        return make_problem(op, shape, dtype, **_op_options(op, _options(args)))
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


# -- commands --------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    on_gpu = bench.gpu_available() if args.device is None else args.device == "cuda"
    cases = [bench.Case(op, shape, dtype, tuple(sorted(o.items()))) for op, shape, dtype, o in _cases(args, on_gpu, True)]
    csv_path = None if args.no_record else os.path.join(args.results, bench.CSV_NAME)
    providers = set(args.providers.split(",")) if args.providers else None
    if args.train != "only":
        bench.run(cases, device=args.device, csv_path=csv_path, plots=None if args.no_record else args.results,
                  providers=providers, api=not args.no_api)
    if args.train != "no" and not args.shapes:
        from . import bench_bn, bench_train
        from .timing import DeviceTiming

        timing = DeviceTiming("cuda" if on_gpu else "cpu")
        copy_gb_s = timing.copy_bandwidth()  # one measurement for both benches' floors
        bench_train.run(csv_path=csv_path, device=timing.device, copy_gb_s=copy_gb_s)
        bench_bn.run(csv_path=csv_path, device=timing.device, copy_gb_s=copy_gb_s)
    elif args.train == "only":
        raise UsageError("--train only runs over the default training shapes (no --shapes)")
    return 0


def _cases(args: argparse.Namespace, on_gpu: bool, benched: bool = False) -> list:
    """(op, shape, dtype, options) for --ops/--shapes/--dtype, or the default shapes: the
    table's (which the shipped logs tune), plus the bench's extra cases when ``benched``."""
    from . import bench

    ops = parse_ops(args.ops, OPS if benched else KERNEL_OPS)
    if args.shapes:
        if len(ops) != 1:
            raise UsageError("--shapes needs exactly one op in --ops")
        dtype = parse_dtype(args.dtype or "float16")
        cases = [(ops[0], parse_shape(s), dtype, _op_options(ops[0], _options(args))) for s in args.shapes]
    else:
        defaults = bench.default_cases(on_gpu) if benched else (bench.GPU_CASES if on_gpu else bench.CPU_CASES)
        # the gradient's default shapes are the forward's
        cases = [(op, c.shape, parse_dtype(args.dtype) if args.dtype else c.dtype, dict(c.options))
                 for op in ops for c in defaults if c.op == op.removesuffix("_grad")]
    for op, shape, dtype, options in cases:
        _problem(op, shape, dtype, argparse.Namespace(**{**vars(args), **options}))
    return cases


def _default_target(args: argparse.Namespace):
    from . import bench

    return parse_target(args.target or ("cuda" if bench.gpu_available() else "llvm"))


def cmd_tune(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import records
    from .api import tune_many

    target = _default_target(args)
    if args.trials < 1:
        raise UsageError(f"--trials must be a positive int, got {args.trials}")
    cases = _cases(args, target.kind.name == "cuda")
    bar = tqdm(total=args.trials * len(cases), unit="trial", desc="tuning")

    done_before = 0  # trials of the shapes tuned earlier in this command

    def progress(done: int, best: float) -> None:
        bar.n = min(done_before + done, bar.total)
        bar.set_postfix_str(f"best {best * 1e3:.4f} ms" if best < float("inf") else "no result yet")
        bar.refresh()

    if args.compare:
        from . import bench

        if target.kind.name != "cuda" or not bench.gpu_available():
            raise UsageError("--compare times kernels on the GPU: it needs --target cuda and a GPU")
    batches = [[case] for case in cases] if args.each else [cases]
    for batch in batches:
        start = time.perf_counter()
        result = tune_many(batch, target, args.trials, args.log_dir, progress)
        print(f"\ntuned {len(batch)} shape(s) in {result.seconds:.1f} s ({time.perf_counter() - start:.1f} s with "
              f"the set-up; the default and the seeds measured in the first {result.seeded:.1f} s); "
              f"log: {result.log_dir}")
        if result.searched < result.trials:
            print(f"  the search ran {result.searched} of {result.trials} trials: it found no untried configuration "
                  "(the default and the cost model's seeds are measured before it)")
        for key, (candidate, best) in result.best.items():
            print(f"  {key}: {candidate} {best * 1e3:.4f} ms"
                  + (f" (not checked against float64: {result.unchecked[key]})" if key in result.unchecked else ""))
        for key, reasons in result.rejected.items():
            for reason in reasons:
                print(f"  REJECTED, wrong outputs (dispatch skips it): {reason}", file=sys.stderr)
        if args.compare:  # shape by shape, so a long run keeps what it has compared
            seconds = dict.fromkeys(result.best, result.seconds)
            bench_cases = [bench.Case(op, shape, dtype, tuple(sorted(o.items()))) for op, shape, dtype, o in batch]
            bench.compare_tuning(bench_cases, args.log_dir, seconds, os.path.join(args.results, bench.CSV_NAME))
        done_before += args.trials * len(batch)
    bar.close()
    for path in records.plot_curves(result.log_dir):
        print(f"  curve: {path}")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    import json

    import tvm

    from .dispatch import choose
    from .kernel import schedule_for

    target = _default_target(args)
    if args.log_dir is not None and not os.path.isdir(args.log_dir):
        raise UsageError(f"--log-dir {args.log_dir!r} is not a folder")
    cases = list(dict.fromkeys(  # a shape given twice builds one function
        (op, shape, dtype, tuple(sorted(options.items())))
        for op, shape, dtype, options in _cases(args, target.kind.name == "cuda")))
    if not cases:
        raise UsageError("nothing to build: --ops names no operator")
    os.makedirs(args.out, exist_ok=True)
    functions, manifest = {}, []
    for op, shape, dtype, option_items in cases:
        options = dict(option_items)
        problem = _problem(op, shape, dtype, argparse.Namespace(**{**vars(args), **options}))
        choice = choose(problem, target, args.log_dir)
        mod = choice.mod if choice.mod is not None else schedule_for(problem, target, choice.candidate, choice.knobs)[0].mod
        name = problem.key()
        functions[name] = mod["main"].with_attr("global_symbol", name)
        params = [{"name": p.name, "shape": [int(d) for d in p.shape], "dtype": str(p.dtype)} for p in mod["main"].params]
        manifest.append({"function": name, "op": op, "input_shape": list(shape), "dtype": dtype,
                         "options": options, "params": params, "candidate": choice.candidate,
                         "knobs": choice.knobs.as_dict(), "chosen_by": choice.source, "why": choice.reason})
    library = os.path.join(args.out, f"tvm_fusion_{'_'.join(sorted({m['op'] for m in manifest}))}.so")
    with target:
        tvm.compile(tvm.IRModule(functions), target=target).export_library(library)
    with open(os.path.join(args.out, "manifest.json"), "w") as handle:
        json.dump({"library": os.path.basename(library), "target": str(target), "functions": manifest}, handle, indent=2)
    print(f"wrote {library} and {os.path.join(args.out, 'manifest.json')} ({len(manifest)} functions)")
    return 0


def cmd_syncbn_cost(args: argparse.Namespace) -> int:
    from .torch import sync_cost

    if args.world_size < 1:
        raise UsageError(f"--world-size must be positive, got {args.world_size}")
    if args.fit_world_size is not None and args.fit_world_size < 2:  # 0 was taken as "not given"
        raise UsageError(f"--fit-world-size must be at least 2 (a collective needs two processes), "
                         f"got {args.fit_world_size}")
    if args.width < 1:
        raise UsageError(f"--width must be positive, got {args.width}")
    try:
        layers = ([(f"bn{i}", c) for i, c in enumerate(parse_shape(args.channels))] if args.channels
                  else sync_cost.model_layers(args.model, args.width))
    except ValueError as err:
        raise UsageError(str(err)) from None
    costs, source = sync_cost.DEFAULT_COSTS, sync_cost.DEFAULT_SOURCE
    if args.fit:
        backend = args.backend or sync_cost.default_backend()
        fit_world = args.fit_world_size or min(args.world_size, sync_cost.local_ranks(backend))
        costs, found = sync_cost.measure_on_host(fit_world, backend)
        source = f"fitted on {fit_world} {backend} processes on this host"
        print(f"{source}:")
        for kind, pairs in found.items():
            print(f"  {kind}: " + ", ".join(f"{b} B {s * 1e6:.1f} us" for b, s in pairs))
    print(sync_cost.table(sync_cost.predict(layers, args.world_size, costs), args.world_size, costs, source))
    return 0


def cmd_cost_model(args: argparse.Namespace) -> int:
    from . import cost_model, records, targets

    target = parse_target(args.target)
    folders = [cost_model.database_folder(log_dir, target) for log_dir in args.log_dir]
    for log_dir, folder in zip(args.log_dir, folders):
        if not records.holds_database(folder):
            raise UsageError(f"no {targets.key(target)} tuning log in {log_dir!r}: expected {folder / records.RECORDS}")
    rows = cost_model.training_rows(args.log_dir, target)
    shapes = len({r.problem for r in rows})
    print(f"{len(rows)} timed configurations of {shapes} problems in {', '.join(args.log_dir)}")
    if args.action == "evaluate":
        if args.held_out:
            held = cost_model.training_rows(args.held_out, target)
            overlap = {r.problem for r in held} & {r.problem for r in rows}
            if overlap:
                raise UsageError(f"held-out shapes also in the training logs: {sorted(p.key() for p in overlap)}")
            print(f"judged on {len({r.problem for r in held})} held-out problems in {', '.join(args.held_out)}")
            print(cost_model.report(cost_model.evaluate_held_out(rows, held, target)))
        else:
            print(cost_model.report(cost_model.evaluate(rows, target)))
        return 0
    model = cost_model.CostModel.train(rows, target)
    if not model.models:
        raise UsageError(f"no timed record of a registered {target.kind.name} candidate to train on")
    out = args.out or str(folders[0] / cost_model.model_file(target))
    model.save(out)
    for op, keys in model.trained_on.items():
        print(f"  {op}: {len(keys)} problems")
    print(f"wrote {out}; dispatch reads it for problems without a record when it lies beside the "
          f"{targets.key(target)} logs of a searched folder, or when ${cost_model.MODEL_ENV} names it")
    return 0


def cmd_grid(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import cost_model, records, registry, tuner

    target = _default_target(args)
    if args.max_configs is not None and args.max_configs < 1:
        raise UsageError(f"--max-configs must be a positive int, got {args.max_configs}")
    if args.preset and args.shapes:
        raise UsageError("--preset names its own shapes: give --preset or --shapes, not both")
    if args.preset:
        ops = parse_ops(args.ops, KERNEL_OPS)
        cases = [c for c in cost_model.PRESETS[args.preset] if c[0] in ops]
    else:
        cases = _cases(args, target.kind.name == "cuda")
    problems = [_problem(op, shape, dtype, argparse.Namespace(**{**vars(args), **options}))
                for op, shape, dtype, options in cases]
    configs = tuner.grid_configs(problems, target, args.max_configs)
    if args.candidates:
        known = {c.name for c in registry.all_candidates() if c.target_kind == target.kind.name}
        unknown = sorted(set(args.candidates) - known)
        if unknown:
            raise UsageError(f"--candidates: no {target.kind.name} candidate named {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        configs = [(p, c, k) for p, c, k in configs if c.name in args.candidates]
    for problem in problems:
        print(f"  {problem.key()}: {sum(1 for p, _, _ in configs if p == problem)} configurations")
    todo = configs
    for folder in [args.log_dir, *(args.skip_timed or [])]:
        left = tuner.untimed(todo, folder, target)
        if len(left) < len(todo):
            print(f"{len(todo) - len(left)} already timed in {cost_model.database_folder(folder, target)}: skipped")
        todo = left
    if args.list:
        print(f"{len(configs)} configurations, {len(todo)} of them to time")
        return 0
    configs = todo
    bar = tqdm(total=len(configs), unit="config", desc="timing")

    def progress(done: int, best: float) -> None:
        bar.n = done
        bar.refresh()

    written = tuner.grid_records(problems, target, args.log_dir, args.max_configs, progress, configs=configs)
    bar.close()
    print(f"{written} of {len(configs)} configurations timed into {records.folder(args.log_dir, target)}")
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
    # Scheduled before anything is printed: a --candidate of another op or target is named
    # by schedule_for's error, not by the TE compute's refusal of its algorithm.
    sch, knobs = schedule_for(problem, target, name)
    section = lambda title: print(f"\n==== {title} " + "=" * max(0, 60 - len(title)))  # noqa: E731
    section("contract")
    print(problem.describe())
    section(f"TE compute ({cand.algorithm})")
    print(prim_func(problem, cand.algorithm).script())
    section("dispatch")
    print(f"{choice.candidate} [{choice.knobs}] ({choice.source}): {choice.reason}")
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

    def add_cases(p: argparse.ArgumentParser, target: bool = True) -> None:
        p.add_argument("--ops", default=",".join(OPS),
                       help=f"comma-separated ops (default: {','.join(OPS)}; tune, build and show also "
                       f"take {', '.join(op for op in KERNEL_OPS if op not in OPS)})")
        p.add_argument("--shapes", nargs="+", help="shapes like 4096x32000 (default: the bench shapes)")
        p.add_argument("--dtype", help="input dtype (default: each default shape's own, float16 for --shapes)")
        if target:
            p.add_argument("--target", help="cuda, llvm or a JSON target dict (default: cuda with a GPU)")
        add_problem_options(p)

    def add_problem_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--layout", choices=["NCHW", "NHWC"], help="bn_stats layout (default NCHW)")
        p.add_argument("--reduction", choices=["none", "mean", "sum"], help="cross_entropy reduction")
        p.add_argument("--label-smoothing", dest="label_smoothing", type=float, help="cross_entropy label smoothing")
        p.add_argument("--ignore-index", dest="ignore_index", type=int, help="cross_entropy ignore_index")
        p.add_argument("--mode", choices=["fused", "from_lse"],
                       help="cross_entropy_grad: the gradient in the forward (fused) or from the saved lse")

    bench = sub.add_parser("bench", help="time every candidate, the default pick and the peers")
    add_cases(bench, target=False)
    bench.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when torch sees a GPU")
    bench.add_argument("--providers", help="comma-separated subset, e.g. 'tvm_fusion,torch eager' (with their "
                       "api rows), 'api' (every api row) or 'tvm_fusion api'")
    bench.add_argument("--no-api", dest="no_api", action="store_true",
                       help="time the kernels only, not the user's calls (the '<provider> api' rows)")
    bench.add_argument("--train", choices=["yes", "no", "only"], default="yes",
                       help="also time cross entropy and BatchNorm forward+backward as a training step "
                       "runs them, and a ResNet SGD step, for tvm_fusion.torch and the peers (on the CPU: "
                       "float32 CPU shapes, torch eager the only peer; default yes; 'only': nothing else)")
    bench.add_argument("--results", default="results", help="folder of the CSV and the PNGs")
    bench.add_argument("--no-record", action="store_true", help="print only: no CSV rows, no PNGs")
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser("tune", help="tune shapes with MetaSchedule and write tuning logs")
    add_cases(tune)
    tune.add_argument("--trials", type=int, default=32, help="trials per shape (default 32)")
    tune.add_argument("--log-dir", dest="log_dir", default="tuning_logs", help="log folder (default tuning_logs)")
    tune.add_argument("--each", action="store_true", help="tune shapes one at a time (time each)")
    tune.add_argument("--compare", action="store_true",
                      help="then time every candidate (default and tuned knobs) against the tuner's pick (GPU)")
    tune.add_argument("--results", default="results", help="folder of the results CSV for --compare")
    tune.set_defaults(func=cmd_tune)

    build = sub.add_parser("build", help="export a shared library of kernels plus a JSON manifest")
    add_cases(build)
    build.add_argument("--log-dir", dest="log_dir", default=None, help="extra tuning log folder")
    build.add_argument("--out", default="build", help="output folder (default build)")
    build.set_defaults(func=cmd_build)

    from .relax.cli import add_subcommand as add_relax

    add_relax(sub)

    cost = sub.add_parser("syncbn-cost", help="SyncBatchNorm's collectives per training step: bytes and time per layer")
    cost.add_argument("--model", default="resnet-small", help="a built-in model: resnet-small (default)")
    cost.add_argument("--width", type=int, default=64, help="resnet-small's channels (default 64)")
    cost.add_argument("--channels", help="BatchNorm layers' channels instead of a model, e.g. 64x128x256")
    cost.add_argument("--world-size", dest="world_size", type=int, default=8, help="ranks to predict for (default 8)")
    cost.add_argument("--fit", action="store_true",
                      help="time all_gather and all_reduce in processes spawned on this host and fit the model "
                      "(default: the stored Gloo fit)")
    cost.add_argument("--fit-world-size", dest="fit_world_size", type=int,
                      help="processes for --fit (default: the world size, at most one a GPU or a core)")
    cost.add_argument("--backend", choices=["gloo", "nccl"], help="for --fit (default: nccl with CUDA GPUs, else gloo)")
    cost.set_defaults(func=cmd_syncbn_cost)

    grid = sub.add_parser("grid", help="time every knob configuration of every candidate into a tuning log "
                          "(the cost model's training data)")
    add_cases(grid)
    grid.add_argument("--log-dir", dest="log_dir", default="tuning_logs", help="log folder (default tuning_logs)")
    grid.add_argument("--max-configs", dest="max_configs", type=int,
                      help="at most this many configurations a candidate, thinned evenly "
                      "(default: as many as the cost model ranks)")
    grid.add_argument("--skip-timed", dest="skip_timed", nargs="+", metavar="LOG",
                      help="also skip what these logs hold timed (read only, compressed ones too). Time into a "
                      "fresh --log-dir and merge after: MetaSchedule's JSON database parses a whole log "
                      "before its first write, which took minutes for the 1500 records of the shipped grids")
    grid.add_argument("--candidates", nargs="+", metavar="NAME",
                      help="only these registry candidates (default: every applicable one)")
    grid.add_argument("--list", action="store_true", help="count the configurations only; time nothing")
    grid.add_argument("--preset", choices=["training", "held-out", "training-channels-last"],
                      help="the cost model's shapes (cost_model.PRESETS: its training shapes, its held-out "
                      "ones, the training shapes in NHWC) instead of --shapes; --ops narrows them")
    grid.set_defaults(func=cmd_grid)

    model = sub.add_parser("cost-model", help="train or evaluate the cost model dispatch uses for shapes "
                           "without a tuning record")
    model.add_argument("action", choices=["train", "evaluate"],
                       help="train: fit and write the model file; evaluate: leave-one-shape-out over the logs")
    model.add_argument("--log-dir", dest="log_dir", nargs="+", required=True,
                       help="log folders (holding <target key>/database_*.json) or database folders")
    model.add_argument("--target", default="cuda", help="cuda, llvm or a JSON target dict (default cuda)")
    model.add_argument("--held-out", dest="held_out", nargs="+",
                       help="evaluate: train on --log-dir and judge on these logs' shapes (none may be in "
                       "--log-dir) instead of leaving one shape out")
    model.add_argument("--out", help="model file (default: cost_model_<target key>.json beside the first "
                       "log's records, where dispatch looks)")
    model.set_defaults(func=cmd_cost_model)

    show = sub.add_parser("show", help="print contract, TE compute, scheduled TIR, trace and source")
    show.add_argument("op", help="bn_stats, cross_entropy, cross_entropy_grad, bn_forward, bn_backward or "
                      "bn_backward_dx")
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
    except (ValueError, TypeError, OSError, RuntimeError) as err:  # a contract's, the file system's or a
        if os.environ.get(DEBUG_ENV):                                # device's answer: one line
            raise
        print(f"tvm-fusion {args.command}: error: {type(err).__name__}: {err} (set {DEBUG_ENV}=1 for the traceback)",
              file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `tvm-fusion show ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    # The package's main, not this __main__ copy's: subcommands elsewhere (relax) raise
    # tvm_fusion.cli.UsageError, which this copy's except clause did not know (a traceback,
    # exit 1, under `python -m tvm_fusion.cli`).
    from tvm_fusion.cli import main as package_main

    sys.exit(package_main())
