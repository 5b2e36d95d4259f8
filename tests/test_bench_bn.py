"""The BatchNorm training bench's CPU path end to end on tiny shapes: every provider
checked against float64 torch, timed, and written to the CSV."""

import csv

import pytest

pytest.importorskip("torch")

from tvm_fusion import bench  # noqa: E402
from tvm_fusion.bench_bn import FORWARD, STEP, TRAIN, run  # noqa: E402

# Tiny, so the run takes seconds: one NCHW and one channels-last input (the kernels
# see them as (N, C, H*W) and (N*H*W, C)); a ResNet of width 4 on 4x4 images.
SHAPES = [((4, 8, 5, 5), "float32", "NCHW"), ((4, 8, 5, 5), "float32", "channels_last")]
RESNET = {"width": 4, "num_classes": 5, "batch": 2, "image": 4}


def test_the_cpu_bench_checks_and_times_every_provider_and_writes_the_csv(tmp_path) -> None:
    path = tmp_path / "benchmarks.csv"
    results = run(str(path), log=lambda *_: None, copy_gb_s=10.0, device="cpu", shapes=SHAPES, resnet=RESNET)
    for op in (FORWARD, TRAIN):
        for layout in ("NCHW", "channels_last"):
            rows = {r.provider: r for r in results if r.case.op == op and r.case.layout == layout}
            assert {"tvm_fusion.torch", "torch eager", "tvm_fusion (default)"} <= set(rows), (op, layout)
            assert any(name.startswith("tvm_fusion:") for name in rows), (op, layout)
            assert "torch.compile" not in rows, (op, layout)  # not on the CPU
    steps = {r.provider for r in results if r.case.op == STEP}
    assert steps == {"torch eager", "tvm_fusion.torch patch"}
    for r in results:
        assert r.status == "ok" and r.median_ms > 0, (r.case.label(), r.provider, r.status)
    with open(path, newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [(r["op"], r["provider"]) for r in written] == [(r.case.op, r.provider) for r in results]
    assert {r["hardware"] for r in written} == {bench.hardware_name(False)}
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in written)
