"""A small ResNet-style CNN with its loss, end to end through torch.export and Relax.

``small_resnet()`` returns a torch module whose ``forward(x, target)`` gives
``(logits, loss)``: every layer kind the passes handle, small enough to compile in
seconds on a CPU:

    stem     conv3x3 (bias) - BN2d - relu
    block    conv3x3 - BN2d - relu - grouped conv3x3 - BN2d, + identity, relu
    head     global average pool - linear - BN1d - relu - linear
    loss     F.cross_entropy(logits, target, label_smoothing=...)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import targets
from .exported import CompiledProgram, compile_exported, device_of
from .fuse_reductions import FuseReductions
from .importer import import_exported


def small_resnet(width: int = 8, num_classes: int = 10, groups: int = 2, label_smoothing: float = 0.0):
    """The model above, in train mode, with BN affine parameters and running
    statistics drawn away from their defaults (so a fold or a statistic that is
    wrong shows)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, padding=1, groups=groups, bias=False)
            self.bn2 = nn.BatchNorm2d(width)

        def forward(self, x):
            y = F.relu(self.bn1(self.conv1(x)))
            return F.relu(self.bn2(self.conv2(y)) + x)

    class SmallResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, width, 3, padding=1)
            self.bn = nn.BatchNorm2d(width)
            self.block = Block()
            self.hidden = nn.Linear(width, width)
            self.bn_hidden = nn.BatchNorm1d(width)
            self.fc = nn.Linear(width, num_classes)

        def forward(self, x, target):
            y = self.block(F.relu(self.bn(self.stem(x))))
            y = F.relu(self.bn_hidden(self.hidden(y.mean(dim=(2, 3)))))
            logits = self.fc(y)
            return logits, F.cross_entropy(logits, target, label_smoothing=label_smoothing)

    generator = torch.Generator().manual_seed(0)
    model = SmallResNet()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                module.weight.copy_(1 + 0.5 * torch.randn(width, generator=generator))
                module.bias.copy_(0.5 * torch.randn(width, generator=generator))
                module.running_mean.copy_(0.5 * torch.randn(width, generator=generator))
                module.running_var.copy_(0.5 + torch.rand(width, generator=generator))
    return model


def example_inputs(batch: int = 4, image: int = 8, num_classes: int = 10, seed: int = 0):
    """(x, target): an NCHW float32 batch and int64 class indices."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, image, image, generator=generator)
    return x, torch.randint(0, num_classes, (batch,), generator=generator)


def export(model, inputs: tuple, mode: str):
    """``torch.export`` of ``model`` in ``mode`` ("train" or "eval")."""
    import torch

    model.train(mode == "train")
    return torch.export.export(model, inputs)


def compile_model(model, inputs: tuple, target: Any = "llvm", mode: str = "eval", log_dir=None) -> CompiledProgram:
    """Export ``model`` in ``mode`` and compile it with the passes for that mode."""
    return compile_exported(export(model, inputs, mode), target, mode, log_dir)


def measure(device: str = "cuda", batch: int = 64, image: int = 32, width: int = 64, num_classes: int = 1000,
            repeat: int = 50) -> dict[str, float]:
    """Median milliseconds per call, all timed in this one run on ``device`` ("cuda" or "cpu"):

    * ``eval_folded`` / ``eval_unfolded``: the compiled inference graph with and
      without FoldBatchNorm (both with the fused loss);
    * ``train_fused`` / ``train_tvm``: the compiled training graph (forward and
      loss, running statistics included) with FuseReductions, and as TVM's default
      pipeline alone compiles it;
    * ``train_torch_eager``: the same forward and loss in PyTorch eager, train mode.

    Everything is compiled first; each variant then runs once untimed (module load,
    first launches, GPU clocks) before ``repeat`` timed calls, five times over.
    """
    import torch
    import tvm
    from torch.utils import benchmark
    from tvm import relax

    target = targets.resolve("cuda" if device == "cuda" else "llvm")
    model = small_resnet(width, num_classes)
    inputs = example_inputs(batch, image, num_classes)
    folded, fused = (compile_model(model, inputs, target, mode) for mode in ("eval", "train"))
    unfolded = import_exported(export(model, inputs, "eval")).mod
    with target:
        executables = {
            "eval_folded": folded.executable,
            "eval_unfolded": tvm.compile(FuseReductions(target)(unfolded), target),
            "train_fused": fused.executable,
            "train_tvm": tvm.compile(fused.imported, target),
        }
    dev = device_of(target)
    args = [tvm.runtime.tensor(t.numpy(), dev) for t in inputs]
    times = {}
    for name, executable in executables.items():
        evaluator = relax.VirtualMachine(executable, dev).time_evaluator("main", dev, number=repeat, repeat=5)
        evaluator(*args)
        times[name] = float(np.median(evaluator(*args).results)) * 1e3
    torch_model = model.to(device).train()
    torch_inputs = [t.to(device) for t in inputs]
    timer = benchmark.Timer("model(*inputs)", globals={"model": torch_model, "inputs": torch_inputs})
    with torch.no_grad():
        timer.timeit(1)
        times["train_torch_eager"] = timer.timeit(repeat).median * 1e3
    return times
