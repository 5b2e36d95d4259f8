"""Compiled kernels and the in-process cache that keeps them.

A :class:`Kernel` is one candidate with one set of knobs, compiled for one problem
and target. ``build_kernel`` compiles it once per process: a second call with the
same (problem, target, candidate, knobs) returns the cached kernel.

Every parameter is compiled with a 16-byte alignment (``PARAM_ALIGNMENT``), what the
kernels really need: a CUDA lane's widest load is 16 bytes, and on the CPU LLVM then
emits unaligned vector loads. TVM's default of 64 bytes let LLVM emit aligned
AVX-512 loads, so every numpy array (malloc gives 16) had to be copied first.
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import tvm
import tvm_ffi
import tvm.support.nvcc  # noqa: F401  (registers the CUDA JIT callback used at load on a GPU)
from tvm.target import Target

from . import async_copy, dependent_launch, folded_prologue, granule_stores, launch_order, registry, single_launch, store_hints, targets
from .compute import prim_func
from .contracts import Problem
from .registry import Knobs


@dataclass
class Kernel:
    """A compiled kernel for one problem; call it with TVM tensors (inputs, then outputs)."""

    problem: Problem
    target: Target
    candidate: str
    knobs: Knobs
    source: str  # "record", "cost model", "heuristic" or "explicit": how the candidate was chosen
    mod: tvm.IRModule = field(repr=False)  # as scheduled (what a tuning record keeps)
    executable: Any = field(repr=False)
    compiled: tvm.IRModule | None = field(default=None, repr=False)  # as compiled (compiled_form)

    def __post_init__(self) -> None:
        self.packed = self.executable["main"]  # the compiled function
        # (name, shape, dtype) of every parameter of the compiled function, inputs
        # first then outputs ("loss_0d" named "loss"): read once, not per call. The
        # workspace (compiled_form) and a launch counter (single_launch) are not among
        # them: ``workspace`` holds the (name, shape, dtype) of the buffers the packed
        # function takes after the outputs, ``counted`` says it takes a counter last,
        # and ``func`` passes both.
        params = [
            (b.name.removesuffix(SCALAR_SUFFIX).removesuffix(AS_CALLED_SUFFIX), tuple(int(d) for d in b.shape),
             str(b.dtype))
            for b in (self.compiled or self.mod)["main"].params
        ]
        self.counted = bool(params) and params[-1][0] == single_launch.COUNTER
        if self.counted:
            params = params[:-1]
        self.workspace = [(name.removesuffix(WORKSPACE_SUFFIX), shape, dtype) for name, shape, dtype in params
                          if name.endswith(WORKSPACE_SUFFIX)]
        self.params = [p for p in params if not p[0].endswith(WORKSPACE_SUFFIX)]
        self.func = self._with_scratch if self.counted or self.workspace else self.packed  # inputs, then outputs
        self._scratch = _scratch_for(self.workspace, self.counted)
        self.num_inputs = self.problem.num_inputs
        self.outputs = self.params[self.num_inputs :]

    def _with_scratch(self, *tensors: Any) -> None:
        self.packed(*tensors, *self._scratch(tensors[0]))

    def __call__(self, *tensors: Any) -> None:
        self.func(*tensors)

    def launches(self) -> int:
        """How many kernels a call launches (CUDA): 1 where single_launch merged two."""
        return len(set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)", self.device_source())))

    def device_source(self) -> str:
        """Generated CUDA source (or LLVM IR on the CPU)."""
        mod = self.executable.mod
        if self.target.kind.name == "cuda":
            return "\n".join(m.inspect_source() for m in mod.imports)
        return mod.inspect_source("ll")

    def describe(self) -> str:
        return f"{self.problem.key()} on {targets.key(self.target)}: {self.candidate} [{self.knobs}] ({self.source})"


def _scratch_for(workspace: list[tuple[str, tuple[int, ...], str]], counter: bool) -> Any:
    """A function that gives a direct call's arguments after the outputs, from its
    first argument ``x``: a buffer per ``workspace`` (name, shape, dtype), then with
    ``counter`` the launch counter. Torch tensors get ``arrays.Kind.scratch``'s sets
    (one per stream, one per call under CUDA graph capture); TVM tensors one set per
    device and TVM stream, which a graph captured over TVM tensors (the bench's) may keep."""
    if not workspace:
        return lambda x: [single_launch.counter_like(x)]
    from . import arrays  # arrays imports this module

    specs = [(shape, dtype) for _, shape, dtype in workspace]
    per_device: dict[Any, Any] = {}

    def get(x: Any) -> list[Any]:
        if isinstance(x, tvm_ffi.Tensor):
            key = single_launch.tvm_key(x.device)
            tail = per_device.get(key)
            if tail is None:
                tail = [tvm.runtime.empty(shape, dtype, x.device) for shape, dtype in specs]
                tail = per_device.setdefault(key, tail + ([single_launch.tvm_counter(x.device)] if counter else []))
            return tail
        scratch = per_device.get(x.device)
        if scratch is None:
            scratch = per_device.setdefault(x.device, arrays.Kind(arrays.inspect(x, "kernel", "x")).scratch(
                specs, counter=counter))
        return scratch()

    return get


PARAM_ALIGNMENT = 16
# TVM_FUSION_WORKSPACE_PARAMS=0 leaves a CUDA kernel's global buffers to TVM's
# workspace pool, as before compiled_form made them parameters (an A/B switch).
WORKSPACE_PARAMS = os.environ.get("TVM_FUSION_WORKSPACE_PARAMS", "1") != "0"
# Parameters that take a 0-d tensor: a reduced loss (and its upstream gradient) is a
# scalar, as torch's is; a (1,) parameter would cost every call a view (2.3 us of
# host time on the H200's host, more than the rest of the argument handling).
SCALAR_PARAMS = ("loss", "dloss")
# A parameter buffer: its shape may hold T.int64(...) dims (kernels past 2^31 elements).
_BUFFER_PARAM = re.compile(r'T\.Buffer\((\((?:[^()]|\([^()]*\))*\)), ("\w+")\)')


# The outer name of a parameter taken in another shape than the body's: a scalar
# (``with_param_alignment``'s scalars) and an input in its caller's shape.
SCALAR_SUFFIX, AS_CALLED_SUFFIX = "_0d", "_as_called"
# The parameter name of a global buffer the schedule allocated (``compiled_form``).
WORKSPACE_SUFFIX = "_workspace"
# A buffer the schedule allocates at the function's root, with its scope if any.
_ROOT_ALLOC = re.compile(r'^(\s*)(\w+) = T\.sblock_alloc_buffer\((\((?:[^()]|\([^()]*\))*\))(?:, ("\w+"))?'
                         r'(?:, scope="(\w+)")?\)$')


def with_param_alignment(mod: tvm.IRModule, alignment: int = PARAM_ALIGNMENT,
                         scalars: tuple[str, ...] = (),
                         shapes: dict[str, tuple[int, ...]] | None = None,
                         workspace: bool = False) -> tvm.IRModule:
    """``mod`` with every parameter buffer of ``main`` declared ``alignment``-byte
    aligned; each parameter named in ``scalars`` whose shape is (1,) taken as a 0-d
    tensor, and each named in ``shapes`` taken in that shape (the same number of
    elements: an input as its caller holds it, so a call needs no view). The body
    still sees its own shape over the same data. With ``workspace``, every global
    buffer allocated at the function's root (a split reduction's cross-block
    partials) becomes a parameter after the outputs, ``<name>_workspace``.

    TVM 0.27's Python API cannot swap a PrimFunc's parameter buffers (the body refers
    to them by identity, and ``specialize`` refuses another alignment), so the
    function is printed, its signature edited and parsed back;
    tests/test_hot_path.py checks that the round trip changes nothing else."""
    reshaped = {name: () for name in scalars}
    reshaped.update(shapes or {})
    lines = mod.script().splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("def main("):
            lines[i] = _BUFFER_PARAM.sub(rf"T.Buffer(\1, \2, align={alignment})", line)
            body_indent = lines[i + 1][: len(lines[i + 1]) - len(lines[i + 1].lstrip())]
            first = i + 2 if lines[i + 1].lstrip().startswith("T.func_attr(") else i + 1  # the body's first line
            for name, outer in reshaped.items():
                param = re.search(rf"\b{name}: T\.Buffer\((\((?:[^()]|\([^()]*\))*\)), (\"\w+\"), "
                                  rf"align={alignment}\)", lines[i])
                if param is None:
                    continue
                shape, dtype = param.group(1), param.group(2)
                dims = [int(d) for d in re.findall(r"\d+", shape.replace("T.int64", ""))]
                if name in scalars:
                    if dims != [1]:  # (1,), or (T.int64(1),) in a kernel past 2^31 elements
                        continue
                    suffix = SCALAR_SUFFIX
                else:
                    if math.prod(outer) != math.prod(dims):
                        raise ValueError(f"with_param_alignment: {name} has {math.prod(dims)} elements, "
                                         f"not the {math.prod(outer)} of {outer}")
                    suffix = AS_CALLED_SUFFIX
                wide = "T.int64" in shape
                outer_text = "(" + "".join(f"T.int64({d})," if wide else f"{d}," for d in outer) + ")"
                lines[i] = (lines[i][: param.start()] + f"{name}{suffix}: T.Buffer({outer_text}, {dtype}, "
                            f"align={alignment})" + lines[i][param.end() :])
                lines.insert(first, f"{body_indent}{name} = T.decl_buffer({shape}, {dtype}, "
                                    f"data={name}{suffix}.data, align={alignment})")
            if workspace:
                lines[i] = _with_workspace_params(lines, i, alignment)
            break
    else:  # pragma: no cover - every module here has a main
        raise ValueError("with_param_alignment: the module has no main")
    return tvm.script.from_source("\n".join(lines))


def _with_workspace_params(lines: list[str], at: int, alignment: int) -> str:
    """``lines[at]``, the signature of ``main``, with a parameter for each global
    buffer allocated at the root of the body that follows; each such allocation in
    ``lines`` becomes a declaration over that parameter's data."""
    signature, params = lines[at], []
    for j in range(at + 1, len(lines)):
        line = lines[j]
        if line.lstrip().startswith(("T.func_attr(", "#", "with T.sblock(\"root\")")) or "T.decl_buffer(" in line:
            continue
        found = _ROOT_ALLOC.match(line)
        if found is None:
            if "T.sblock_alloc_buffer(" in line:
                continue  # another root allocation, in a form not parsed here: on chip, or kept as it is
            break
        indent, name, shape, dtype, scope = found.groups()
        if scope not in (None, "global"):
            continue
        dtype = dtype or '"float32"'
        params.append(f"{name}{WORKSPACE_SUFFIX}: T.Buffer({shape}, {dtype}, align={alignment})")
        lines[j] = (f"{indent}{name} = T.decl_buffer({shape}, {dtype}, data={name}{WORKSPACE_SUFFIX}.data, "
                    f"align={alignment})")
    if not params:
        return signature
    head, tail = signature.rsplit(")", 1)  # "def main(...)" then the return annotation and ":"
    return f"{head}, {', '.join(params)}){tail}"


def compiled_form(mod: tvm.IRModule, problem: Problem,
                  input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = (),
                  workspace: bool = False) -> tvm.IRModule:
    """The module as :func:`build_kernel` compiles it: 16-byte aligned parameters,
    a sum's or mean's loss (and upstream gradient) 0-d, each input named in
    ``input_shapes`` taken in the caller's shape, and with ``workspace`` (CUDA) each
    global buffer the schedule allocates a parameter after the outputs.

    Why ``workspace``: TVM allocates such a buffer per call from its own pool
    (``TVMBackendAllocWorkspace`` in the host code), a pool per host thread, which
    knows nothing of torch's streams: two streams' calls shared one set of partials,
    a CUDA graph captured the pool's pointer, and the pool freed its memory at exit
    after the CUDA runtime had gone (``cudaErrorCudartUnloading``). As parameters,
    the launchers pass buffers of their own per stream (``arrays.Kind.scratch``)."""
    reduced = getattr(problem, "reduction", "none") != "none"
    mod = granule_stores.module_stores_in_place(mod)  # before its buffers could become workspace
    return with_param_alignment(mod, PARAM_ALIGNMENT, SCALAR_PARAMS if reduced else (), dict(input_shapes),
                                workspace=workspace)


_CACHE: dict[tuple, Kernel] = {}
_LOCK = threading.Lock()


def schedule_for(problem: Problem, target: Target, candidate: str, knobs: Knobs | None = None):
    """The scheduled IRModule of ``candidate`` for ``problem`` (knobs default if None)."""
    cand = registry.get(candidate)
    if cand.target_kind != target.kind.name:
        raise ValueError(f"candidate {candidate} is for {cand.target_kind}, not {target.kind.name}")
    if not cand.applies(problem):
        raise ValueError(f"candidate {candidate} does not apply to {problem.describe()}")
    knobs = knobs or cand.default_for(problem, target)
    sch = cand.apply(prim_func(problem, cand.algorithm), target, knobs=knobs)
    if sch is None:
        why = cand.unsupported(target)
        raise ValueError(f"candidate {candidate} declined {problem.describe()}" + (f" ({why})" if why else ""))
    return sch, knobs


def build_kernel(
    problem: Problem,
    target: Target,
    candidate: str,
    knobs: Knobs | None = None,
    source: str = "explicit",
    mod: tvm.IRModule | None = None,
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> Kernel:
    """Compile (or fetch from the cache) ``candidate`` for ``problem`` on ``target``.

    ``mod`` is an already scheduled module (a tuning record's); else the candidate
    schedules the problem with ``knobs``. ``input_shapes``, (name, shape) pairs:
    inputs the compiled function takes in their caller's shape (``compiled_form``)."""
    cand = registry.get(candidate)
    knobs = knobs or cand.default_for(problem, target)
    overlapped = dependent_launch.wanted(problem)
    # single_launch.ENABLED, launch_order.ENABLED, store_hints.ENABLED,
    # async_copy.ENABLED and whether this build's launches are overlapped
    # (dependent_launch.wanted) are in the key: a build with the merge, the reversal,
    # the evict-first stores, the asynchronous copies or the overlap switched (an A/B in
    # one process) is another kernel.
    cache_key = (problem, str(target), candidate, knobs, None if mod is None else tvm_ffi.structural_hash(mod),
                 input_shapes, single_launch.ENABLED, folded_prologue.ENABLED, launch_order.ENABLED, store_hints.ENABLED, async_copy.ENABLED,
                 overlapped, WORKSPACE_PARAMS)
    with _LOCK:
        if cache_key in _CACHE:
            return _CACHE[cache_key]
    if mod is None:
        sch, knobs = schedule_for(problem, target, candidate, knobs)
        mod = sch.mod
    with target:
        compiled = compiled_form(mod, problem, input_shapes, workspace=WORKSPACE_PARAMS and target.kind.name == "cuda")
        if overlapped:
            compiled = dependent_launch.asked(compiled, problem)
        compiled = folded_prologue.asked(compiled, candidate)
        pipeline = launch_order.PIPELINE
        if target.kind.name == "cuda" and problem.op in SINGLE_LAUNCH_OPS and single_launch.ENABLED:
            compiled, pipeline = single_launch.with_launch_counter(compiled), single_launch.PIPELINE
        if getattr(problem, "in_place", False):
            pipeline = ALIASED_PIPELINES[pipeline]
        executable = tvm.compile(compiled, target=target, tir_pipeline=pipeline)
    kernel = Kernel(problem, target, candidate, knobs, source, mod, executable, compiled)
    with _LOCK:
        return _CACHE.setdefault(cache_key, kernel)


# The calls whose kernels single_launch merges in pairs where it can: a call of one
# launch fewer costs the host one TVM launch less (README, "Results").
SINGLE_LAUNCH_OPS = ("cross_entropy", "bn_stats", "cross_entropy_grad")


def _aliased_pipeline(base: str, **kwargs):
    """The ``base`` pipeline (``launch_order``'s or ``single_launch``'s), then every
    function's no-alias promise withdrawn.

    For a problem that writes an output over an input (the gradient over the logits):
    SplitHostDevice marks every device kernel ``tirx.noalias``, which prints each
    pointer ``__restrict__`` and lets the compiler read the input through the
    non-coherent cache or reload it after a store. Without it the generated code keeps
    every load before the stores that follow it."""
    pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline(base, **kwargs)

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.WithdrawNoAlias")
    def withdraw_no_alias(mod, _ctx):
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and "tirx.noalias" in func.attrs:
                mod[gvar] = func.with_attr("tirx.noalias", False)
        return mod

    return tvm.transform.Sequential([pipeline, withdraw_no_alias]), finalize_host, finalize_device


# The aliased form of each base pipeline, by the base's name.
ALIASED_PIPELINES = {base: f"{base}_aliased" for base in (launch_order.PIPELINE, single_launch.PIPELINE)}
for _base, _name in ALIASED_PIPELINES.items():
    tvm.tirx.compilation_pipeline.register_tir_pipeline(_name, functools.partial(_aliased_pipeline, _base))


def cache_size() -> int:
    return len(_CACHE)
