"""``tvm-fusion relax PROGRAM.pt2``: compile a saved torch.export program with our passes.

Prints every decision of the passes, then the operator counts of main before and
after them. ``tvm_fusion.cli`` wires it in with ``add_subcommand(subparsers)``.
"""

from __future__ import annotations

import argparse
import pathlib


def add_subcommand(subparsers) -> None:
    """Add ``relax`` to the ``tvm-fusion`` sub-commands (``func`` is set to run it)."""
    relax = subparsers.add_parser(
        "relax", help="compile a torch.export program (.pt2) with the fusion passes and print what they did"
    )
    relax.add_argument("program", help="a file written by torch.export.save")
    relax.add_argument("--target", default="llvm", help="llvm, cuda or a JSON target dict (default llvm)")
    relax.add_argument("--mode", choices=["train", "eval"], default="eval",
                       help="train: fuse BN statistics and the loss; eval: fold BN, fuse the loss")
    relax.add_argument("--log-dir", dest="log_dir", help="tuning logs, one folder per target")
    relax.set_defaults(func=cmd_relax)


def cmd_relax(args: argparse.Namespace) -> int:
    from ..cli import UsageError, parse_target
    from .exported import compile_exported
    from .graph import count_ops

    target = parse_target(args.target)
    path = pathlib.Path(args.program)
    if not path.is_file():
        raise UsageError(f"no such file: {args.program}")
    if args.log_dir is not None and not pathlib.Path(args.log_dir).is_dir():
        raise UsageError(f"--log-dir {args.log_dir!r} is not a folder")
    import torch

    try:
        program = torch.export.load(path)
    except Exception as err:  # noqa: BLE001 - torch raises several kinds for a bad file
        lines = str(err).strip().splitlines()
        detail = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
        raise UsageError(f"{args.program} is not a torch.export program ({detail})") from None
    compiled = compile_exported(program, target, args.mode, args.log_dir)
    for decision in compiled.report:
        print(decision)
    before, after = count_ops(compiled.imported), count_ops(compiled.mod)
    print(f"\n{'operator':<32}{'before':>8}{'after':>8}")
    for name in sorted(set(before) | set(after)):
        print(f"{name:<32}{before[name]:>8}{after[name]:>8}")
    print(f"\noutputs: {', '.join(compiled.outputs)}")
    return 0
