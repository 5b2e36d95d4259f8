"""tvm_fusion for PyTorch training: differentiable ops and drop-in modules.

``tvm_fusion.torch.cross_entropy`` and ``tvm_fusion.torch.CrossEntropyLoss`` stand in
for ``torch.nn.functional.cross_entropy`` and ``torch.nn.CrossEntropyLoss`` (class
index targets, (B, V) logits), eager and under ``torch.compile(fullgraph=True)``.
``tvm_fusion.torch.fold`` folds inference BatchNorm into the conv or linear before it.
"""

from .cross_entropy import CrossEntropyLoss, cross_entropy
from .fold import fold

__all__ = ["CrossEntropyLoss", "cross_entropy", "fold"]
