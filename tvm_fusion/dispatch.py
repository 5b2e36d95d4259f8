"""Dispatch: which candidate and knobs a problem gets on a target, and why."""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from . import registry
from .contracts import Problem
from .kernel import Kernel, build_kernel
from .registry import Knobs


@dataclass(frozen=True)
class Choice:
    candidate: str
    knobs: Knobs
    source: str  # "record" or "heuristic"
    reason: str


def choose(problem: Problem, target: Target) -> Choice:
    """The registry's heuristic pick: first applicable candidate in dispatch order."""
    cand = registry.default_candidate(problem, target)
    knobs = cand.default_for(problem, target)
    names = [c.name for c in registry.applicable(problem, target)]
    reason = (
        f"no tuning record; first of the applicable candidates {names} in dispatch "
        f"order that prefers this shape, with its default knobs"
    )
    return Choice(cand.name, knobs, "heuristic", reason)


def kernel_for(problem: Problem, target: Target) -> Kernel:
    choice = choose(problem, target)
    return build_kernel(problem, target, choice.candidate, choice.knobs, choice.source)
