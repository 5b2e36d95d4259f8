"""Kernel-IR candidates and the registry that holds them.

A candidate is one schedule of one decomposition (``algorithm``) of one operator for
one target kind. Like a DLight rule, ``apply(func, target, tunable)`` returns a
schedule, or ``None`` when the candidate does not apply, so the predicate and the
result are one thing. Its launch knobs are a frozen dataclass with a
``default_for`` heuristic and an ``all_configs`` space; with ``tunable=True`` every
knob is drawn with ``sample_categorical`` so MetaSchedule can search inside the
candidate as well as between candidates.

The dispatch order per (operator, target kind) is written once, in
``tvm_fusion.schedules.DISPATCH_ORDER``: most specific first, fallback last.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Iterator
from typing import Any, ClassVar

from tvm import s_tir, tirx
from tvm.target import Target

from .compute import algorithm_of, problem_of
from .contracts import Problem

CANDIDATE_ANNOTATION = "tvm_fusion.candidate"
KNOB_ANNOTATION = "tvm_fusion.knob."
# The block that carries those annotations: one every decomposition of the operator
# has. Not the root block: annotating it makes a later split edit the original
# module in place (TVM 0.27), which breaks MetaSchedule's trace replays.
ANNOTATED_BLOCK = {"bn_stats": "mean", "bn_backward": "dx", "bn_backward_dx": "dx", "bn_forward": "y",
                   "cross_entropy": "first_bad_row", "cross_entropy_grad": "dlogits"}


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Base of every candidate's launch knobs. Subclasses add int fields."""

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.as_dict().items())


class Candidate:
    """One kernel-IR realization. Subclasses set the class attributes and override
    ``applies``, ``choices`` (the knob space), ``default_for`` and ``schedule``."""

    name: ClassVar[str]
    op: ClassVar[str]
    target_kind: ClassVar[str]
    algorithm: ClassVar[str]
    knobs: ClassVar[type[Knobs]]
    # What the generated code shows (checked by tests/test_cuda_codegen.py):
    # "shuffles" (warp shuffles), "vector_loads" (16-byte loads where the vector
    # knob times the element size is 16 bytes), "atomics".
    claims: ClassVar[dict[str, bool]] = {}

    # -- predicate and knobs ---------------------------------------------------
    def applies(self, problem: Problem) -> bool:
        """True when the candidate computes ``problem`` correctly."""
        return problem.op == self.op

    def unsupported(self, target: Target) -> str:
        """Why ``target`` cannot run this candidate's kernels ("" when it can): such a
        candidate is not applicable there and declines to schedule."""
        return ""

    def choices(self, problem: Problem, target: Target) -> dict[str, list[int]]:
        """Values each knob may take for ``problem``: the candidate's design space."""
        raise NotImplementedError

    def default_for(self, problem: Problem, target: Target) -> Knobs:
        raise NotImplementedError

    def builds(self, problem: Problem, knobs: Knobs) -> bool:
        """False for a configuration of the space that is known not to build (the
        candidate says why), so the cost model never ranks it; True by default."""
        return True

    def near_default(self, problem: Problem, target: Target) -> list[Knobs]:
        """Configurations next to the default that the cost model should rank and the
        grids time besides the evenly thinned space (``cost_model.thinned``), most
        promising first; none by default."""
        return []

    def all_configs(self, problem: Problem, target: Target) -> list[Knobs]:
        space = self.choices(problem, target)
        names = list(space)
        return [
            self.knobs(**dict(zip(names, values)))
            for values in itertools.product(*(space[n] for n in names))
        ]

    # -- schedule ---------------------------------------------------------------
    def schedule(self, sch: s_tir.Schedule, problem: Problem, knobs: Any) -> None:
        """Schedule ``sch`` in place. ``knobs`` fields are ints or sampled ExprRVs;
        the loop structure must not depend on their values (MetaSchedule replays the
        trace with other decisions)."""
        raise NotImplementedError

    def apply(
        self,
        func: tirx.PrimFunc,
        target: Target,
        tunable: bool = False,
        knobs: Knobs | None = None,
    ) -> s_tir.Schedule | None:
        if "tvm_fusion.problem" not in func.attrs or algorithm_of(func) != self.algorithm:
            return None
        problem = problem_of(func)
        if target.kind.name != self.target_kind or not self.applies(problem) or self.unsupported(target):
            return None
        sch = s_tir.Schedule(func)
        self.apply_to(sch, problem, target, tunable, knobs)
        return sch

    def apply_to(
        self,
        sch: s_tir.Schedule,
        problem: Problem,
        target: Target,
        tunable: bool = False,
        knobs: Knobs | None = None,
    ) -> None:
        """Schedule ``sch`` (whose function computes ``problem``) in place."""
        root = sch.get_sblock(ANNOTATED_BLOCK[self.op])
        if tunable:  # each knob annotated right after its sample, as the traces replay them
            sch.annotate(root, CANDIDATE_ANNOTATION, self.name)
            values = {}
            for field, options in self.choices(problem, target).items():
                default = getattr(self.default_for(problem, target), field)
                decision = options.index(default) if default in options else 0
                values[field] = sch.sample_categorical(
                    options, [1.0 / len(options)] * len(options), decision=decision
                )
                sch.annotate(root, KNOB_ANNOTATION + field, values[field])
            self.schedule(sch, problem, _SampledKnobs(values))
        else:
            knobs = knobs or self.default_for(problem, target)
            self.annotate_choice(sch, root, knobs)
            self.schedule(sch, problem, knobs)

    def annotate_choice(self, sch: s_tir.Schedule, block: Any, knobs: Any) -> None:
        """Write the candidate and its knobs (ints, or the sampled ExprRVs the trace
        replays) on ``block``, as :meth:`apply_to` writes them on ``ANNOTATED_BLOCK``'s:
        for a schedule that inlines that block into another (:func:`annotated_block`
        then finds them there)."""
        sch.annotate(block, CANDIDATE_ANNOTATION, self.name)
        values = knobs.as_dict() if isinstance(knobs, Knobs) else dict(vars(knobs))
        for field, value in values.items():
            sch.annotate(block, KNOB_ANNOTATION + field, value)

    def __repr__(self) -> str:
        return f"<candidate {self.name} ({self.op}, {self.target_kind}, {self.algorithm})>"


def annotated_choice(sch: s_tir.Schedule, op: str) -> tuple[str, Knobs]:
    """The candidate and knobs that :meth:`Candidate.apply_to` wrote on a scheduled
    ``op`` (a tuning record's trace replayed, say), read back from the annotations."""
    notes = sch.get(annotated_block(sch, op)).annotations
    name = str(notes[CANDIDATE_ANNOTATION])
    values = {k[len(KNOB_ANNOTATION):]: int(v) for k, v in notes.items() if k.startswith(KNOB_ANNOTATION)}
    return name, get(name).knobs(**values)


def annotated_block(sch: s_tir.Schedule, op: str) -> Any:
    """The block that carries a scheduled ``op``'s choice: ``ANNOTATED_BLOCK[op]``, or
    where the schedule inlined that one (``cross_entropy_grad_row_in_cluster`` inlines
    ``dlogits``, a gather, into its map's store), the block annotated instead
    (:meth:`Candidate.annotate_choice`)."""
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    named = [b for b in blocks if sch.get(b).name_hint == ANNOTATED_BLOCK[op]]
    carriers = named or [b for b in blocks if CANDIDATE_ANNOTATION in sch.get(b).annotations]
    if len(carriers) != 1:
        raise ValueError(f"registry: expected one block carrying the choice of a scheduled {op}, found {len(carriers)}")
    return carriers[0]


def replayed_choice(record: Any, op: str) -> tuple[str, Knobs, float, Any]:
    """A timed tuning record's ``(candidate, knobs, median seconds, scheduled module)``:
    its trace replayed on its workload, the choice read from the annotations."""
    sch = s_tir.Schedule(record.workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    candidate, knobs = annotated_choice(sch, op)
    return candidate, knobs, statistics.median(float(s) for s in record.run_secs), sch.mod


def traced_choice(trace_json: Any) -> tuple[str, Knobs] | None:
    """The ``(candidate, knobs)`` a tuning record's trace annotates, read off the
    trace's JSON (``[instructions, decisions]``, as the log stores it) without parsing
    or replaying it: each knob annotation's value is a literal or a
    ``SampleCategorical``'s pick, which the trace's decision names. What
    :func:`replayed_choice` reads from the replayed schedule at a fraction of the cost
    (a record parsed and replayed: about 60 ms on the 2-core CPU machine, 226 s for the
    3261 rows of the shipped H200 logs). None where the trace says something else (an
    annotation removed, a value of another kind): the caller replays then."""
    found = traced_annotations(trace_json)
    if found is None:
        return None
    name, values = found
    if not all(isinstance(v, int) for v in values.values()):
        return None
    return name, get(name).knobs(**values)


def traced_annotations(trace_json: Any) -> tuple[str, dict[str, Any]] | None:
    """The candidate a tuning record's trace (its JSON) annotates and the value of each
    knob it annotates, by knob name; None where the trace cannot be read so (see
    :func:`traced_choice`)."""
    try:
        insts, decisions = trace_json[0], dict((int(i), d) for i, d in trace_json[1])
        picks: dict[str, int] = {}  # a sampled random variable's name -> the value its decision picks
        notes: dict[str, Any] = {}
        for position, (kind, inputs, attrs, outputs) in enumerate(insts):
            if kind == "SampleCategorical":
                picks[outputs[0]] = int(attrs[0][int(decisions[position])])
            elif kind in ("Annotate", "Unannotate") and str(attrs[0]).startswith((CANDIDATE_ANNOTATION, KNOB_ANNOTATION)):
                if kind == "Unannotate":
                    return None
                value = inputs[1]
                if isinstance(value, bool):
                    return None
                if isinstance(value, int):
                    notes[attrs[0]] = value
                elif isinstance(value, str) and value.startswith('"'):
                    notes[attrs[0]] = json.loads(value)  # a string literal
                else:
                    notes[attrs[0]] = picks[value]  # a random variable: KeyError if not sampled
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    name = notes.pop(CANDIDATE_ANNOTATION, None)
    if not isinstance(name, str):
        return None
    return name, {k[len(KNOB_ANNOTATION):]: v for k, v in notes.items()}


class _SampledKnobs:
    """Knob fields as ExprRVs, read like the frozen dataclass."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)


def ladder(value: int, steps: list[tuple[int, int]], last: int) -> int:
    """First ``v`` of ``steps = [(limit, v), ...]`` with ``value <= limit``, else ``last``."""
    for limit, chosen in steps:
        if value <= limit:
            return chosen
    return last


# -- the registry ---------------------------------------------------------------
_REGISTRY: dict[str, Candidate] = {}


def register(cls: type[Candidate]) -> type[Candidate]:
    """Class decorator: one instance of each candidate lives in the registry."""
    if cls.name in _REGISTRY:
        raise ValueError(f"candidate {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def get(name: str) -> Candidate:
    _load()
    if name not in _REGISTRY:
        raise KeyError(f"unknown candidate {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def candidates(op: str, target_kind: str) -> list[Candidate]:
    """Candidates for (op, target kind) in dispatch order."""
    from . import schedules

    return [get(name) for name in schedules.DISPATCH_ORDER.get((op, target_kind), [])]


def one_launch_twin(name: str, problem: Problem, target: Target) -> Candidate | None:
    """The candidate that is ``name``'s schedule in fewer launches (its ``twin_of`` is
    ``name``: the same row kernel and knobs, a first kernel folded in), where it applies
    to ``problem`` on ``target``; else None."""
    _load()
    return next((c for c in _REGISTRY.values() if getattr(c, "twin_of", None) == name and c.applies(problem)
                 and not c.unsupported(target)), None)


def applicable(problem: Problem, target: Target) -> list[Candidate]:
    return [c for c in candidates(problem.op, target.kind.name) if c.applies(problem) and not c.unsupported(target)]


def default_candidate(problem: Problem, target: Target) -> Candidate:
    """The first candidate in dispatch order that applies and prefers this problem.

    ``prefers(problem, target)`` gets the target so that a threshold on the hardware
    (an SM count) is read from it, not assumed; a candidate without one prefers all."""
    found = applicable(problem, target)
    for cand in found:
        if getattr(cand, "prefers", lambda p, t: True)(problem, target):
            return cand
    if found:
        return found[-1]
    raise LookupError(f"no {target.kind.name} candidate applies to {problem.describe()}")


def all_candidates() -> Iterator[Candidate]:
    _load()
    return iter(_REGISTRY.values())


def _load() -> None:
    from . import schedules  # noqa: F401  (registers every candidate)
