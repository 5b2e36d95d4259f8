"""Semantic level: operator contracts (argument checks, canonical problems, float64 references)."""

from .bn_stats import BNStatsProblem, bn_stats_problem
from .cross_entropy import CrossEntropyProblem, TargetOutOfRangeError, cross_entropy_problem
from .cross_entropy_grad import CrossEntropyGradProblem, cross_entropy_grad_problem

Problem = BNStatsProblem | CrossEntropyProblem | CrossEntropyGradProblem

__all__ = [
    "BNStatsProblem",
    "CrossEntropyGradProblem",
    "CrossEntropyProblem",
    "Problem",
    "TargetOutOfRangeError",
    "bn_stats_problem",
    "cross_entropy_grad_problem",
    "cross_entropy_problem",
]
