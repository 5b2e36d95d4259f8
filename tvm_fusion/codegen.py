"""Reading generated CUDA without a GPU: nvcc to PTX, ptxas resource usage, instruction counts.

Before spending device time, look at what a candidate compiles to: are the loads
16 bytes wide (``ld.global.v4``, or ``cp.async`` of 16 bytes straight into shared
memory: :mod:`tvm_fusion.async_copy`), are the cross-thread steps warp shuffles
(``shfl.sync``), are there atomics, does anything spill to local memory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

from .kernel import Kernel


@dataclass
class CudaReport:
    """What the generated code of one kernel contains."""

    ptx: str = field(repr=False)
    vector_loads: int  # 16-byte global loads (ld.global[.nc].v4 / v2.u64, cp.async of 16 bytes)
    shuffles: int  # shfl.sync
    atomics: int  # atom. / red.
    local_memory: int  # ld.local / st.local in PTX (ptxas may still promote them)
    kernels: list[str]
    registers: dict[str, int]  # per kernel, from ptxas -v
    spill_bytes: dict[str, int]
    stack_bytes: dict[str, int]  # local arrays ptxas could not keep in registers


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


def _arch(kernel: Kernel) -> str:
    return str(kernel.target.attrs.get("arch", "sm_90"))


# The flag that matters of those TVM 0.27 compiles CUDA kernels with (tvm.support.nvcc):
# --use_fast_math, always on its default NVRTC path (and on its nvcc path unless
# TVM_CUDA_NVCC_NO_FAST_MATH is set). Code read without it is not the code that runs:
# expf, for one, is then about 8 instructions instead of a multiply and a MUFU.EX2 (the
# padded warp-per-row row kernel of 65536x1000 fp16: 488 SASS instructions a warp
# without, 296 with).
TVM_NVCC_FLAGS = ("--use_fast_math",)


def cuda_report(kernel: Kernel) -> CudaReport:
    """Compile the kernel's CUDA source with nvcc (PTX and cubin) as TVM does
    (``TVM_NVCC_FLAGS``) and count what matters."""
    if kernel.target.kind.name != "cuda":
        raise ValueError(f"cuda_report needs a CUDA kernel, got target {kernel.target.kind.name}")
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc was not found (PATH or CUDA_HOME): cannot compile CUDA here")
    source = kernel.device_source()
    arch = _arch(kernel)
    with tempfile.TemporaryDirectory() as tmp:
        cu = os.path.join(tmp, "kernel.cu")
        with open(cu, "w") as handle:
            handle.write(source)
        ptx_path = os.path.join(tmp, "kernel.ptx")
        subprocess.run(
            [nvcc, "-ptx", f"-arch={arch}", "-O3", *TVM_NVCC_FLAGS, "-o", ptx_path, cu],
            check=True, capture_output=True, text=True,
        )
        with open(ptx_path) as handle:
            ptx = handle.read()
        cubin = subprocess.run(
            [nvcc, "-cubin", f"-arch={arch}", "-O3", *TVM_NVCC_FLAGS, "-Xptxas=-v", "-o", os.path.join(tmp, "k.cubin"), cu],
            check=True, capture_output=True, text=True,
        )
    registers, spills, stack = _parse_ptxas(cubin.stderr + cubin.stdout)
    return CudaReport(
        ptx=ptx,
        vector_loads=len(re.findall(r"ld\.global(?:\.nc)?(?:\.L\d::\w+)*\.v(?:4\.(?:u|b|f)32|2\.(?:u|b|f)64)", ptx))
        + len(re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^]]+\], \[[^]]+\], 16;", ptx)),
        shuffles=len(re.findall(r"shfl\.sync", ptx)),
        atomics=len(re.findall(r"\b(?:atom|red)\.", ptx)),
        local_memory=len(re.findall(r"\b(?:ld|st)\.local", ptx)),
        kernels=re.findall(r"\.entry\s+(\w+)", ptx),
        registers=registers,
        spill_bytes=spills,
        stack_bytes=stack,
    )


def _parse_ptxas(text: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    registers: dict[str, int] = {}
    spills: dict[str, int] = {}
    stack: dict[str, int] = {}
    current = None
    for line in text.splitlines():
        match = re.search(r"Compiling entry function '(\w+)'", line)
        if match:
            current = match.group(1)
        match = re.search(r"(\d+) bytes spill stores", line)
        if match and current:
            spills[current] = int(match.group(1))
        match = re.search(r"(\d+) bytes stack frame", line)
        if match and current:
            stack[current] = int(match.group(1))
        match = re.search(r"Used (\d+) registers", line)
        if match and current:
            registers[current] = int(match.group(1))
    return registers, spills, stack
