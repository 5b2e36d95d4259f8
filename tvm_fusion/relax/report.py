"""What a graph pass did at each place it looked, in words a user can act on."""

from __future__ import annotations

import logging
from typing import NamedTuple

LOG = logging.getLogger("tvm_fusion.relax")


class Decision(NamedTuple):
    """One place a pass looked at: ``action`` is "fused", "folded" or "kept"."""

    location: str  # "main: lv4 = relax.nn.batch_norm(lv2, ...)"
    action: str
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.action}: {self.reason}"


def record(report: list[Decision], location: str, action: str, reason: str) -> None:
    """Append to ``report`` and log: a kept operator is a warning (it may cost speed)."""
    decision = Decision(location, action, reason)
    report.append(decision)
    LOG.log(logging.WARNING if action == "kept" else logging.INFO, "%s", decision)
