"""Semantic level: operator contracts (argument checks, canonical problems, float64 references)."""

from .bn_backward import BNBackwardProblem, bn_backward_problem
from .bn_backward_dx import BNBackwardDxProblem, bn_backward_dx_problem
from .bn_forward import BNForwardProblem, bn_forward_problem
from .bn_stats import BNStatsProblem, bn_stats_problem
from .cross_entropy import CrossEntropyProblem, TargetOutOfRangeError, cross_entropy_problem
from .cross_entropy_grad import CrossEntropyGradProblem, cross_entropy_grad_problem

Problem = BNStatsProblem | BNBackwardProblem | BNBackwardDxProblem | BNForwardProblem | CrossEntropyProblem | CrossEntropyGradProblem

__all__ = [
    "BNBackwardDxProblem",
    "BNBackwardProblem",
    "BNForwardProblem",
    "BNStatsProblem",
    "CrossEntropyGradProblem",
    "CrossEntropyProblem",
    "Problem",
    "TargetOutOfRangeError",
    "bn_backward_dx_problem",
    "bn_backward_problem",
    "bn_forward_problem",
    "bn_stats_problem",
    "cross_entropy_grad_problem",
    "cross_entropy_problem",
]
