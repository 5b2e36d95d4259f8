"""tvm_fusion for PyTorch training: differentiable ops and drop-in modules.

``tvm_fusion.torch.cross_entropy`` and ``tvm_fusion.torch.CrossEntropyLoss`` stand in
for ``torch.nn.functional.cross_entropy`` and ``torch.nn.CrossEntropyLoss`` (class
index targets, (B, V) logits), eager and under ``torch.compile(fullgraph=True)``.
``tvm_fusion.torch.fold`` folds inference BatchNorm into the conv or linear before it;
``patch(model)`` / ``unpatch(model)`` swap a model's ``nn.CrossEntropyLoss`` modules.
"""

from .cross_entropy import CrossEntropyLoss, cross_entropy
from .fold import fold
from .patch import PatchedCrossEntropyLoss, Replaced, patch, unpatch

__all__ = ["CrossEntropyLoss", "PatchedCrossEntropyLoss", "Replaced", "cross_entropy", "fold", "patch", "unpatch"]
