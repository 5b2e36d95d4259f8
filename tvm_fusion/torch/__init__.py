"""tvm_fusion for PyTorch training: differentiable ops and drop-in modules.

``tvm_fusion.torch.cross_entropy`` and ``tvm_fusion.torch.CrossEntropyLoss`` stand in
for ``torch.nn.functional.cross_entropy`` and ``torch.nn.CrossEntropyLoss`` (class
index targets, (B, V) logits); ``batch_norm``, ``BatchNorm1d``, ``BatchNorm2d`` and
``BatchNorm3d`` for ``F.batch_norm`` and ``nn.BatchNorm1d/2d/3d`` (training and eval,
running statistics,
contiguous or channels-last); eager and under ``torch.compile(fullgraph=True)``.
``tvm_fusion.torch.fold`` folds inference BatchNorm into the conv or linear before it;
``patch(model)`` / ``unpatch(model)`` swap a model's BatchNorm and CrossEntropyLoss
modules for these. ``SyncBatchNorm`` and ``convert_sync_batchnorm`` stand in for
``nn.SyncBatchNorm`` (one all_gather forward, one all_reduce backward, over
``torch.distributed``); ``sync_cost`` models what those collectives cost.
"""

from .batch_norm import BatchNorm1d, BatchNorm2d, BatchNorm3d, batch_norm
from .cross_entropy import CrossEntropyLoss, cross_entropy
from .fold import fold
from .patch import PatchedCrossEntropyLoss, Replaced, patch, unpatch
from .sync_batch_norm import SyncBatchNorm, convert_sync_batchnorm, sync_batch_norm

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "CrossEntropyLoss", "PatchedCrossEntropyLoss", "Replaced", "SyncBatchNorm",
           "batch_norm", "convert_sync_batchnorm", "cross_entropy", "fold", "patch", "sync_batch_norm", "unpatch"]
