"""The host-cost breakdown runs and says what it times (its figures come from the
device; here only that every step is timed and the launchers are left as found)."""

import json

import pytest
import tvm_ffi

import tvm_fusion as tf
from helpers import assert_close, random_floats, rng, torch_or_none
from tvm_fusion import api, arrays, host_cost
from tvm_fusion.contracts import bn_stats as bn_ref

torch = torch_or_none()


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_breakdown_times_every_step_and_restores_the_launchers(monkeypatch, tmp_path):
    monkeypatch.setattr(host_cost, "CALLS", 2)
    monkeypatch.setattr(host_cost, "REPEATS", 1)
    out = tmp_path / "host.json"
    assert host_cost.main(["--device", "cpu", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["host_us"]
    for step in ("torch.empty(3) float32", "TVM call, empty kernel, 6 torch tensors",
                 "bn_stats 8x3x224x224 fp16: tf.bn_stats(x)", "cross_entropy 128x32000 fp16: F.cross_entropy",
                 "bn_stats 8x3x224x224 fp16: call, launch a no-op, outputs preallocated"):
        assert figures[step] > 0, step
    # The launchers it took apart launch again, into fresh outputs.
    x = torch.from_numpy(random_floats(rng(), (8, 3, 224, 224), "float32")).half()
    mean, var = tf.bn_stats(x)
    other_mean, _ = tf.bn_stats(x)
    assert mean.data_ptr() != other_mean.data_ptr()
    ref_mean, ref_var = bn_ref.reference(x.numpy(), "NCHW")
    assert_close(mean.numpy(), ref_mean, 2e-3, 2e-3, "mean")
    assert_close(var.numpy(), ref_var, 2e-3, 2e-3, "var")
    launcher = api._LAUNCHERS[("bn_stats", arrays.signature(x), "NCHW")]
    cells = dict(zip(launcher.__code__.co_freevars, launcher.__closure__))
    assert isinstance(cells["func"].cell_contents, tvm_ffi.Function), "the no-op launch was left in place"


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_training_steps_time_ours_and_torchs_parts_and_append_csv_rows(monkeypatch, tmp_path):
    """``--train`` times each training-step part for tvm_fusion.torch and torch eager
    (every part a positive figure for both) and appends one CSV row each, with no
    bandwidth (a host time moves no bytes)."""
    import csv

    monkeypatch.setattr(host_cost, "CALLS", 2)
    monkeypatch.setattr(host_cost, "TRAIN_ROUNDS", 1)
    out, table = tmp_path / "host.json", tmp_path / "bench.csv"
    assert host_cost.main(["--device", "cpu", "--train", "--csv", str(table), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["host_us"]
    assert len(figures) == 10 and all(us > 0 for us in figures.values())
    assert "BatchNorm2d forward+backward 4x8x5x5 float32 layout=channels_last: torch eager" in figures
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 10 and {r["provider"] for r in rows} == {"tvm_fusion.torch: host time",
                                                                  "torch eager: host time"}
    assert all(float(r["median_ms"]) > 0 and r["gb_s"] == "" and r["frac_copy"] == "" for r in rows)
    assert {r["options"] for r in rows} == {"", "layout=channels_last"}
    with pytest.raises(SystemExit):
        host_cost.main(["--csv", str(table)])  # --csv without --train
