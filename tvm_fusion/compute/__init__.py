"""Algorithm level: each operator's decompositions into map/reduce patterns, as TE compute."""

from __future__ import annotations

import json

from tvm import te, tirx

from ..contracts import (
    BNBackwardDxProblem, BNBackwardProblem, BNForwardProblem, BNStatsProblem, CrossEntropyGradProblem,
    CrossEntropyProblem, Problem,
)
from .bn_backward import ALGORITHMS as BN_BACKWARD_ALGORITHMS
from .bn_backward import PART_COPIES as BN_BACKWARD_PART_COPIES
from .bn_backward import bn_backward_te
from .bn_backward_dx import ALGORITHMS as BN_BACKWARD_DX_ALGORITHMS
from .bn_backward_dx import bn_backward_dx_te
from .bn_forward import ALGORITHMS as BN_FORWARD_ALGORITHMS
from .bn_forward import PART_COPIES as BN_FORWARD_PART_COPIES
from .bn_forward import bn_forward_te
from .bn_forward import default_algorithm as bn_forward_default
from .bn_stats import ALGORITHMS as BN_ALGORITHMS
from .bn_stats import bn_stats_te
from .cross_entropy import ALGORITHMS as CE_ALGORITHMS
from .cross_entropy import cross_entropy_te
from .cross_entropy_grad import ALGORITHMS as CE_GRAD_ALGORITHMS
from .cross_entropy_grad import DEFAULT_FOR_MODE, MODE_OF, cross_entropy_grad_te

ALGORITHMS = {"bn_stats": BN_ALGORITHMS, "bn_backward": BN_BACKWARD_ALGORITHMS, "bn_forward": BN_FORWARD_ALGORITHMS,
              "bn_backward_dx": BN_BACKWARD_DX_ALGORITHMS,
              "cross_entropy": CE_ALGORITHMS, "cross_entropy_grad": CE_GRAD_ALGORITHMS}
# cross_entropy_grad's default depends on the problem's mode (DEFAULT_FOR_MODE): see default_algorithm.
DEFAULT_ALGORITHM = {"bn_stats": "shifted", "bn_backward": "dual_reduce", "bn_backward_dx": "map",
                     "cross_entropy": "three_pass"}


def default_algorithm(problem: Problem) -> str:
    if isinstance(problem, CrossEntropyGradProblem):
        return DEFAULT_FOR_MODE[problem.mode]
    if isinstance(problem, BNForwardProblem):  # training's statistics or eval's running ones
        return bn_forward_default(problem)
    return DEFAULT_ALGORITHM[problem.op]


def algorithms_for(problem: Problem) -> tuple[str, ...]:
    """The decompositions that compute ``problem`` (a gradient's: those of its mode)."""
    if isinstance(problem, CrossEntropyGradProblem):
        return tuple(a for a in CE_GRAD_ALGORITHMS if MODE_OF[a] == problem.mode)
    if isinstance(problem, BNForwardProblem):
        return tuple(a for a in BN_FORWARD_ALGORITHMS if (a == "running") != problem.training)
    return ALGORITHMS[problem.op]


def te_tensors(problem: Problem, algorithm: str | None = None) -> list[te.Tensor]:
    algorithm = algorithm or default_algorithm(problem)
    if isinstance(problem, BNStatsProblem):
        return bn_stats_te(problem, algorithm)
    if isinstance(problem, BNBackwardProblem):
        return bn_backward_te(problem, algorithm)
    if isinstance(problem, BNBackwardDxProblem):
        return bn_backward_dx_te(problem, algorithm)
    if isinstance(problem, BNForwardProblem):
        return bn_forward_te(problem, algorithm)
    if isinstance(problem, CrossEntropyProblem):
        return cross_entropy_te(problem, algorithm)
    if isinstance(problem, CrossEntropyGradProblem):
        return cross_entropy_grad_te(problem, algorithm)
    raise TypeError(f"no compute for {problem!r}")


# Decompositions whose loops over a row test ``likely(k < H)`` (cross_entropy_grad's
# fused_head) or ``likely`` that a window position lies inside its row (fused_granules):
# the build runs TVM's loop partition on const loops for them (launch_order.lowered),
# which splits such a loop where the test changes, each part without it where it holds.
PARTITION_LIKELY = ("fused_head", "fused_granules")
PARTITION_LIKELY_ATTR = "tvm_fusion.partition_likely"
# Decompositions whose schedules pipeline a persistent kernel's rounds (the next part
# copied in with cp.async while this one is reduced and mapped): the build lowers them
# as :mod:`tvm_fusion.async_rounds` says. ``bn_forward_cluster_half`` takes
# ``shifted_half_parts`` unpipelined, and so the same lowering: no pipeline to lower, and
# storage rewrite off (its H100 timings are of that build).
ASYNC_ROUNDS = ("shifted_half_parts", "dual_reduce_half_parts")
ASYNC_ROUNDS_ATTR = "tvm_fusion.async_rounds"
# The parts decompositions (bn_stats.parts), and how many part-sized copies each
# keeps on chip: what a schedule of one sizes its shared memory by.
PART_COPIES = {**BN_FORWARD_PART_COPIES, **BN_BACKWARD_PART_COPIES}


def prim_func(problem: Problem, algorithm: str | None = None) -> tirx.PrimFunc:
    """The operator as a TensorIR PrimFunc, tagged with the problem it computes.

    The attributes ``tvm_fusion.problem`` (JSON) and ``tvm_fusion.algorithm`` let a
    schedule candidate, or MetaSchedule replaying one, see the shape it is for.
    """
    algorithm = algorithm or default_algorithm(problem)
    func = te.create_prim_func(te_tensors(problem, algorithm))
    attrs = {
        "global_symbol": "main",
        "tvm_fusion.op": problem.op,
        "tvm_fusion.algorithm": algorithm,
        "tvm_fusion.problem": problem_to_json(problem),
    }
    if algorithm in PARTITION_LIKELY:
        attrs[PARTITION_LIKELY_ATTR] = True
    if algorithm in ASYNC_ROUNDS:
        attrs[ASYNC_ROUNDS_ATTR] = True
    return func.with_attrs(attrs)



def problem_to_json(problem: Problem) -> str:
    fields = {k: v for k, v in problem.__dict__.items()}
    if fields.get("in_place") is False:  # the out-of-place gradient's JSON (and records) as before
        del fields["in_place"]
    if isinstance(problem, (BNStatsProblem, BNBackwardProblem, BNBackwardDxProblem, BNForwardProblem)):
        fields["shape"] = list(problem.shape)
        fields["input_shape"] = list(problem.input_shape)
    return json.dumps({"op": problem.op, **fields}, sort_keys=True)


def problem_from_json(text: str) -> Problem:
    fields = json.loads(text)
    op = fields.pop("op")
    if op in ("bn_stats", "bn_backward", "bn_backward_dx", "bn_forward"):
        fields["shape"] = tuple(fields["shape"])
        fields["input_shape"] = tuple(fields["input_shape"])
        kind = {"bn_stats": BNStatsProblem, "bn_backward": BNBackwardProblem, "bn_backward_dx": BNBackwardDxProblem,
                "bn_forward": BNForwardProblem}[op]
        return kind(**fields)
    if op == "cross_entropy_grad":
        return CrossEntropyGradProblem(**fields)
    return CrossEntropyProblem(**fields)


def problem_of(func: tirx.PrimFunc) -> Problem:
    return problem_from_json(str(func.attrs["tvm_fusion.problem"]))


def algorithm_of(func: tirx.PrimFunc) -> str:
    return str(func.attrs["tvm_fusion.algorithm"])


__all__ = [
    "ALGORITHMS", "DEFAULT_ALGORITHM", "algorithm_of", "algorithms_for", "default_algorithm", "prim_func",
    "problem_of", "te_tensors",
]
