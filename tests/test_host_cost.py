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
