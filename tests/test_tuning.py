"""Tuner, tuning logs, dispatch from records and the CLI, on the CPU (llvm).

The tunes are tiny (a small shape, two or three trials): what is checked is the
plumbing — records MetaSchedule's JSONDatabase opens as they are, dispatch using
them, nothing lost when a tune is killed, bad lines reported with file and line —
not the speed-ups, which are measured on the GPU host."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm
import tvm_ffi

import tvm_fusion as tf
from helpers import assert_close, random_floats, rng
from tvm.s_tir import meta_schedule as ms
from tvm_fusion import dispatch, records, registry, targets, tuner
from tvm_fusion.compute import prim_func
from tvm_fusion.contracts import cross_entropy as ce_ref

CPU = targets.resolve("llvm")
SHAPE = (16, 256)
CLI = [sys.executable, "-m", "tvm_fusion.cli"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    result = tf.tune("cross_entropy", shape=SHAPE, dtype="float32", target="llvm", trials=2, log_dir=str(log_dir))
    return log_dir, result


def test_tune_writes_a_json_database_that_metaschedule_opens(tuned):
    log_dir, result = tuned
    folder = records.folder(log_dir, CPU)
    assert pathlib.Path(result.log_dir) == folder
    db = ms.database.JSONDatabase(
        path_workload=str(folder / records.WORKLOADS), path_tuning_record=str(folder / records.RECORDS)
    )
    assert len(db) >= 1
    assert result.best and result.seconds > 0
    trace = str(db.get_all_tuning_records()[0].trace)
    assert "tvm_fusion.candidate" in trace  # every record says which candidate it came from


def test_progress_reports_the_measurements_before_the_search(tmp_path):
    """The default's time is reported at 0 trials, before the search's first batch, and
    the result says how long those measurements took (a stalled tune then shows which
    stage it stalled in)."""
    calls = []
    result = tf.tune("bn_stats", shape=(8, 16, 64), dtype="float32", target="llvm", trials=1, log_dir=str(tmp_path),
                     progress=lambda done, best: calls.append((done, best)))
    assert calls[0][0] == 0 and 0 < calls[0][1] < float("inf")
    assert calls[-1][0] == result.searched and calls[-1][1] <= calls[0][1]
    assert 0 < result.seeded < result.seconds


def test_dispatch_uses_the_record_and_explains_why(tuned):
    log_dir, _ = tuned
    problem = tf.make_problem("cross_entropy", SHAPE, "float32")
    choice = dispatch.choose(problem, CPU, log_dir)
    assert choice.source == "record" and choice.mod is not None
    text = tf.explain("cross_entropy", SHAPE, "float32", "llvm", log_dir=str(log_dir))
    assert "tuning record" in text and choice.candidate in text
    # Other options on the same shape reuse the record's candidate and knobs.
    other = dispatch.choose(tf.make_problem("cross_entropy", SHAPE, "float32", label_smoothing=0.1), CPU, log_dir)
    assert other.source == "record (default options)"
    # And the record's kernel computes the right thing.
    kernel = dispatch.kernel_for(problem, CPU, log_dir)
    gen = rng()
    logits = random_floats(gen, SHAPE, "float32")
    target = gen.integers(0, SHAPE[1], SHAPE[0])
    import tvm

    outs = [tvm.runtime.empty(shape, dtype) for _, shape, dtype in kernel.outputs]
    kernel(tvm.runtime.tensor(logits), tvm.runtime.tensor(target), *outs)
    assert_close(outs[-2].numpy(), ce_ref.reference(logits, target), 1e-5, 1e-5, "tuned kernel")  # 0-d
    assert "heuristic" in tf.explain("cross_entropy", (16, 128), "float32", "llvm", log_dir=str(log_dir))


def test_corrupt_line_is_reported_with_file_and_line_and_the_rest_loads(tuned, tmp_path):
    log_dir, _ = tuned
    source = records.folder(log_dir, CPU)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / records.WORKLOADS).write_text((source / records.WORKLOADS).read_text())
    good = [line for line in (source / records.RECORDS).read_text().splitlines() if line.strip()]
    (broken / records.RECORDS).write_text("\n".join([good[0], '[0, {"truncated', *good[1:]]) + "\n")
    loaded = records.load(broken)
    assert loaded.records == len(good)
    assert len(loaded.problems) == 1
    problem = loaded.problems[0]
    assert problem.line == 2 and problem.path.endswith(records.RECORDS)
    assert f"{records.RECORDS}:2:" in str(problem)
    with pytest.raises(records.LogLineError, match=r"database_tuning_record\.json:2:"):
        records.load(broken, strict=True)


def test_dispatch_parses_a_workloads_records_when_asked_and_finds_what_a_full_load_finds():
    """records.IndexedLog (what dispatch reads) against records.load on the shipped H200
    log: nothing parsed until asked, then every workload's top records the same."""
    folder = records.folder(records.SHIPPED, tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    full = records.load(folder).database
    lazy = records.IndexedLog(folder)
    assert not lazy.database.get_all_tuning_records()
    mods = []
    for record in full.get_all_tuning_records():
        if not any(tvm_ffi.structural_equal(record.workload.mod, m) for m in mods):
            mods.append(record.workload.mod)
    assert len(mods) >= 9
    seen = lambda db, mod: [(str(r.trace), [float(t) for t in r.run_secs]) for r in db.get_top_k(db.commit_workload(mod), 64)]
    first = lazy.database_for(mods[0])
    assert 0 < len(first.get_all_tuning_records()) < len(full.get_all_tuning_records())
    for mod in mods:
        assert seen(lazy.database_for(mod), mod) == seen(full, mod)
    assert len(lazy.database.get_all_tuning_records()) == len(full.get_all_tuning_records())
    other = tvm.IRModule({"main": prim_func(tf.make_problem("cross_entropy", (3, 5), "float32"), "online")})
    assert lazy.database_for(other) is None


def test_dispatch_skips_a_corrupt_record_naming_its_file_and_line(tuned, tmp_path, caplog):
    log_dir, _ = tuned
    source = records.folder(log_dir, CPU)
    broken = records.folder(tmp_path, CPU)
    broken.mkdir(parents=True)
    (broken / records.WORKLOADS).write_text((source / records.WORKLOADS).read_text())
    good = [line for line in (source / records.RECORDS).read_text().splitlines() if line.strip()]
    (broken / records.RECORDS).write_text("\n".join([good[0], '[0, {"truncated', *good[1:]]) + "\n")
    problem = tf.make_problem("cross_entropy", SHAPE, "float32")
    with caplog.at_level("WARNING", logger="tvm_fusion.records"):
        found = dispatch.records_of(problem, CPU, tmp_path)
    assert f"{records.RECORDS}:2:" in caplog.text
    assert len(found) == len(dispatch.records_of(problem, CPU, log_dir)) > 0


@pytest.mark.parametrize("suffix", [".xz", ".gz"])
def test_a_compressed_log_loads_like_the_plain_one_and_refuses_writes(tuned, tmp_path, suffix):
    """A log kept as database_*.json.xz or .gz (the cost model's grids) reads the same
    records as its plain files; writing records into that folder is refused with the
    reason."""
    import gzip
    import lzma

    compress = {".xz": lzma.compress, ".gz": gzip.compress}[suffix]
    log_dir, _ = tuned
    source = records.folder(log_dir, CPU)
    packed = tmp_path / "packed"
    packed.mkdir()
    for name in (records.WORKLOADS, records.RECORDS):
        (packed / (name + suffix)).write_bytes(compress((source / name).read_bytes()))
    assert records.holds_database(packed) and not (packed / records.RECORDS).exists()
    plain, compressed = records.load(source, strict=True), records.load(packed, strict=True)
    assert compressed.records == plain.records > 0
    def timed(log):
        return sorted((str(r.trace), tuple(float(s) for s in r.run_secs)) for r in log.database.get_all_tuning_records())

    assert timed(compressed) == timed(plain)
    with pytest.raises(ValueError, match=f"compressed log \\(database_workload.json{suffix}.*decompress it"):
        records.json_database(packed)
    assert not records.holds_database(tmp_path)


def test_merge_two_logs(tuned, tmp_path):
    log_dir, _ = tuned
    source = records.folder(log_dir, CPU)
    count = records.load(source).records
    merged = tmp_path / "merged"
    assert records.merge([source, source], merged) == 2 * count
    assert records.load(merged).records == 2 * count


def test_kill_during_tuning_keeps_finished_records_and_resumes(tmp_path):
    cmd = CLI + ["tune", "--ops", "bn_stats", "--shapes", "8x16x64", "--dtype", "float32", "--target", "llvm",
                 "--trials", "64", "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log = records.folder(tmp_path, CPU) / records.RECORDS
    deadline = time.time() + 240
    try:
        while time.time() < deadline and (not log.exists() or not log.read_text().strip()):
            time.sleep(0.5)
        assert log.exists() and log.read_text().strip(), "no record was written in time"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    loaded = records.load(log.parent)
    assert loaded.records >= 1  # every finished record survived the kill
    before = loaded.records
    # Resume: tuning again appends to the same log.
    tf.tune("bn_stats", shape=(8, 16, 64), dtype="float32", target="llvm", trials=1, log_dir=str(tmp_path))
    assert records.load(log.parent).records >= before


@pytest.mark.parametrize("sub", ["bench", "tune", "build", "show"])
def test_cli_help(sub):
    out = subprocess.run(CLI + [sub, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout


def test_cli_as_a_module_reports_a_relax_usage_error_in_one_line(tmp_path):
    """Under ``python -m tvm_fusion.cli`` the relax subcommand's UsageError (the package
    module's class, not __main__'s) escaped main with a traceback and exit status 1."""
    out = subprocess.run(CLI + ["relax", str(tmp_path / "missing.pt2")], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "no such file" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["show", "softmax", "4x8"], "unknown op 'softmax'"),
        (["show", "cross_entropy", "4xA"], "malformed shape '4xA'"),
        (["show", "cross_entropy", "4x8", "--target", "metal"], "'metal'"),
        (["show", "cross_entropy", "4x8", "--dtype", "int8"], "unknown dtype 'int8'"),
        (["tune", "--ops", "bn_stats", "--shapes", "0x3", "--target", "llvm"], "malformed shape"),
        (["build", "--ops", "nope"], "unknown op 'nope'"),
        (["bench", "--ops", "bn_stats", "--shapes", "2x3x-1"], "malformed shape"),
        (["show", "bn_stats", "2x3x4", "--target", '{"kind": "cuda"'], "not valid JSON"),
        (["bench", "--ops", "cross_entropy_grad"], "unknown op 'cross_entropy_grad'"),
        (["show", "cross_entropy_grad", "4x8", "--label-smoothing", "2"], "label_smoothing"),
        # int() took these: "64xx3" was (64, 3), "x4x3" (4, 3), "1_0x3" (10, 3)
        (["show", "bn_stats", "64xx3"], "malformed shape '64xx3'"),
        (["show", "bn_stats", "x4x3"], "malformed shape 'x4x3'"),
        (["show", "bn_stats", "1_0x3"], "malformed shape '1_0x3'"),
        (["show", "bn_stats", " 4x3"], "malformed shape ' 4x3'"),
        (["build", "--ops", ""], "nothing to build"),  # wrote a library of no function
        (["syncbn-cost", "--fit", "--fit-world-size", "0"], "--fit-world-size must be at least 2"),  # became 2
        (["syncbn-cost", "--width", "-8"], "--width must be positive"),  # torch's "negative dimension"
        (["bench", "--ops", "bn_stats", "--shapes", "4x3", "--dtype", "float32", "--device", "cpu", "--no-record",
          "--providers", "nonexistent"], "no provider matched 'nonexistent'"),  # ran numpy alone, exit 0
        (["build", "--ops", "bn_stats", "--log-dir", "/nonexistent/logs"], "is not a folder"),
        # a contract's error inside a command: one line, not a traceback
        (["show", "bn_stats", "4x3", "--candidate", "cross_entropy_online", "--target", "llvm"], "error: ValueError"),
        # named the TE compute's algorithm ('cross_entropy_grad: algorithm must be one of ...'), not the candidate
        (["show", "cross_entropy_grad", "4x8", "--candidate", "cross_entropy_parallel", "--target", "llvm"],
         "candidate cross_entropy_parallel does not apply to cross_entropy_grad"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, words, capsys):
    """In this process (``test_cli_help`` runs the command itself): a subprocess a
    case cost 4-5 s of imports on the 2-core CI machine. An exception escaping
    ``main`` fails the test with its traceback."""
    from tvm_fusion import cli

    try:
        code = cli.main(args)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert words in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_tune_passes_layout_only_to_batchnorm():
    """``tune --ops cross_entropy ... --layout NCHW`` raised a TypeError traceback on the
    H200 (cross entropy has no layout option): the cases now carry each op's options."""
    from tvm_fusion import cli

    for op, shape, given, layout in (("cross_entropy", "8x4", "NCHW", None), ("bn_stats", "8x4x4x2", "NHWC", "NHWC")):
        args = cli.build_parser().parse_args(["tune", "--ops", op, "--shapes", shape, "--layout", given])
        (case,) = cli._cases(args, on_gpu=False)
        assert case[3].get("layout") == layout
        tf.make_problem(*case[:3], **case[3])


def test_cli_build_writes_library_and_manifest(tmp_path):
    out = subprocess.run(
        CLI + ["build", "--ops", "cross_entropy", "--shapes", "8x100", "--dtype", "float32", "--target", "llvm",
               "--out", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (tmp_path / manifest["library"]).exists()
    (entry,) = manifest["functions"]
    assert entry["candidate"] == "cross_entropy_parallel" and entry["chosen_by"] == "heuristic"
    import tvm

    lib = tvm.runtime.load_module(str(tmp_path / manifest["library"]))
    gen = rng()
    logits, target = random_floats(gen, (8, 100), "float32"), gen.integers(0, 100, 8)
    outs = [tvm.runtime.empty(tuple(p["shape"]), p["dtype"]) for p in entry["params"][2:]]
    lib[entry["function"]](tvm.runtime.tensor(logits), tvm.runtime.tensor(target), *outs)
    assert np.isclose(outs[-2].numpy()[0], ce_ref.reference(logits, target), rtol=1e-5)


def test_cli_show_prints_every_level():
    out = subprocess.run(CLI + ["show", "cross_entropy", "4x64", "--target", "llvm", "--dtype", "float32"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for section in ("contract", "TE compute", "dispatch", "scheduled TIR", "trace", "LLVM IR"):
        assert f"==== {section}" in out.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_arguments_are_valid_class_indices_and_real_logits(dtype):
    import tvm

    problem = tf.make_problem("cross_entropy", (512, 3000), dtype)
    func = tf.compute.prim_func(problem, "three_pass")
    args_info = [(str(p.name), str(p.dtype), [int(d) for d in p.shape]) for p in func.params]
    (args,) = tuner.alloc_valid_arguments(tvm.cpu(), [info for info in args_info], 1)
    logits = args[0].numpy().astype(np.float32)
    target = args[1].numpy()
    assert np.isfinite(logits).all() and 0.5 < logits.std() < 2.0  # real values, not random bits
    assert len(np.unique(logits[0])) > 1000 and not np.array_equal(logits[0], logits[1])
    valid = (target >= 0) & (target < 3000)
    assert ((target == -100) | valid).all() and valid.sum() > 400 and (target == -100).any()


def test_runner_arguments_are_made_once_per_role_dtype_and_shape(monkeypatch):
    import tvm

    monkeypatch.setattr(tuner, "_ARGUMENTS", {})

    def args_info(batch, classes):
        func = tf.compute.prim_func(tf.make_problem("cross_entropy_grad", (batch, classes), "float16"), "fused")
        return [(str(p.name), str(p.dtype), [int(d) for d in p.shape]) for p in func.params]

    first = args_info(64, 3000)
    assert sum(info[2] == [64, 3000] for info in first) == 2  # the logits and their gradient
    (a,) = tuner.alloc_valid_arguments(tvm.cpu(), first, 1)
    (b,) = tuner.alloc_valid_arguments(tvm.cpu(), first, 1)
    assert all(x is y for x, y in zip(a, b))  # a later trial gets the same tensors
    assert len({id(x) for x in a}) == len(a)  # never one buffer for two arguments
    target = a[1].numpy()
    assert ((target == -100) | ((target >= 0) & (target < 3000))).all() and (target >= 0).sum() > 40
    # another problem's arguments; past the budget the older ones go, the call's own never
    monkeypatch.setattr(tuner, "ARGUMENT_CACHE_BYTES", 1)
    (c,) = tuner.alloc_valid_arguments(tvm.cpu(), args_info(32, 5000), 1)
    assert c[1].numpy().max() < 5000 and c[0] is not a[0] and c[1] is not a[1]
    assert set(map(id, tuner._ARGUMENTS.values())) == set(map(id, c))


@pytest.mark.parametrize("other_ms, picked", [(0.995, "default"), (0.9, "other")])
def test_a_record_displaces_the_default_only_when_clearly_faster(tmp_path, other_ms, picked):
    from tvm_fusion import registry
    from tvm_fusion.compute import prim_func

    problem = tf.make_problem("cross_entropy", SHAPE, "float32")
    cand = registry.default_candidate(problem, CPU)
    default_knobs = cand.default_for(problem, CPU)
    other_knobs = next(k for k in cand.all_configs(problem, CPU) if k != default_knobs)
    db = records.json_database(records.folder(tmp_path, CPU))
    workload = db.commit_workload(tvm.IRModule({"main": prim_func(problem, cand.algorithm)}))
    for knobs, ms_taken in ((default_knobs, 1.0), (other_knobs, other_ms)):
        sch = cand.apply(prim_func(problem, cand.algorithm), CPU, knobs=knobs)
        args = ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"])
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [ms_taken * 1e-3], CPU, args))
    choice = dispatch.choose(problem, CPU, tmp_path)
    assert choice.source == "record"
    assert choice.knobs == (default_knobs if picked == "default" else other_knobs)
    assert ("default pick stays" in choice.reason) == (picked == "default")


def test_candidate_records_give_each_candidates_fastest_record_of_this_problem(tuned):
    from tvm_fusion import bench

    log_dir, _ = tuned
    problem = tf.make_problem("cross_entropy", SHAPE, "float32")
    found = bench.candidate_records(problem, CPU, log_dir)
    best = dispatch.records_of(problem, CPU, log_dir)
    assert set(found) == {f.candidate for f in best}
    fastest = min(best, key=lambda f: f.seconds)
    assert found[fastest.candidate][0] == fastest.knobs
    assert bench.candidate_records(tf.make_problem("cross_entropy", (16, 128), "float32"), CPU, log_dir) == {}


def test_the_gradient_is_tuned_and_dispatched_like_the_forward(tmp_path):
    """tf.tune / explain / build take cross_entropy_grad: MetaSchedule measures its
    candidates, dispatch then picks the record, and the CLI shows and builds it."""
    shape, options = (32, 256), {"label_smoothing": 0.1}
    result = tf.tune("cross_entropy_grad", shape, "float32", target="llvm", trials=2, log_dir=str(tmp_path), **options)
    ((key, (candidate, seconds)),) = result.best.items()
    assert key.startswith("cross_entropy_grad_32x256") and candidate.startswith("cross_entropy_grad") and seconds > 0
    problem = tf.make_problem("cross_entropy_grad", shape, "float32", **options)
    choice = dispatch.choose(problem, CPU, str(tmp_path))
    assert choice.source == "record" and choice.candidate == candidate
    assert "tuning record" in tf.explain("cross_entropy_grad", shape, "float32", "llvm", log_dir=str(tmp_path), **options)
    from_lse = tf.build("cross_entropy_grad", shape, "float32", target="llvm", mode="from_lse", reduction="sum")
    assert from_lse.candidate == "cross_entropy_grad_from_lse_parallel" and from_lse.problem.mode == "from_lse"
    with pytest.raises(TypeError, match="unknown option"):
        tf.make_problem("cross_entropy", shape, "float32", mode="fused")
    out = subprocess.run(CLI + ["show", "cross_entropy_grad", "8x100", "--dtype", "float32", "--target", "llvm",
                                "--mode", "from_lse"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "cross_entropy_grad (from_lse)" in out.stdout and "LLVM IR" in out.stdout


# A CUDA target with what MetaSchedule's postprocs read (resolve() fills these on a GPU).
SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
                          "max_shared_memory_per_block": 49152, "thread_warp_size": 32, "max_num_threads": 1024})


@pytest.mark.parametrize("op, shape", [("bn_forward", (64, 256, 56, 56)), ("bn_backward", (64, 256, 56, 56)),
                                       ("bn_forward", (64, 56, 56, 256)), ("cross_entropy", (4096, 32000))])
def test_every_cuda_task_takes_only_its_candidates_postprocs(op, shape):
    """A task of several candidates (a SpaceGeneratorUnion) used to take the target's
    postprocs, whose RewriteUnboundBlock raised on BatchNorm's finalize block (bound to
    blockIdx alone): tuning bn_forward and bn_backward failed on the H200 before the
    first trial. Now every task's postprocs are KnobsMatch and VerifyGPUCode alone, and
    each design space goes through them without an error."""
    from tvm_fusion.tuner import tasks_for

    layout = "NHWC" if op.startswith("bn") and shape[-1] == 256 else None
    problem = tf.make_problem(op, shape, "float16", **({"layout": layout} if layout else {}))
    contexts = tasks_for(problem, SM90)
    assert contexts
    for ctx in contexts:
        generator = ctx.space_generator
        # KnobsMatch (a Python postprocessor), then TVM's own
        assert [type(p).__name__ for p in generator.postprocs] == ["_PyPostproc", "VerifyGPUCode"], ctx.task_name
        for sch in generator.generate_design_space(ctx.mod):
            for postproc in generator.postprocs:
                postproc.apply(sch)  # True or False (too many threads, say), never an error


def _replays(problem, cand, count: int):
    """``cand``'s design space on ``problem``, replayed ``count`` times with other knob
    samples, as MetaSchedule's search draws its population (decisions dropped)."""
    from tvm.s_tir import Schedule, Trace
    from tvm_fusion.compute import prim_func
    from tvm_fusion.tuner import _space_fn

    mod = tvm.IRModule({"main": prim_func(problem, cand.algorithm)})
    space = Schedule(mod, seed=1)
    with SM90:
        _space_fn(cand, problem, SM90)(space)
    for seed in range(count):
        replay = Schedule(mod, seed=seed + 7)
        with SM90:
            Trace(list(space.trace.insts), {}).apply_to_schedule(replay, remove_postproc=True)
        yield replay


def test_a_replayed_design_space_is_kept_only_where_its_knobs_build_it():
    """The search replays a design space's trace with other sampled knobs. For
    bn_stats_channels_last on 16x35x35x288 fp16 NHWC such a replay failed the whole tune
    on the H200 (get_loops "4 vs. 3": rows=1 folded a unit loop away) or, where the
    sampled run took the shared-memory row sums, kept them for knobs the candidate builds
    without them (rows > vector: threads writing the next block's channels). Now every
    replay applies, and KnobsMatch keeps exactly those equal to their knobs' schedule."""
    from tvm_fusion import registry
    from tvm_fusion.compute import prim_func
    from tvm_fusion.tuner import KnobsMatch

    problem = tf.make_problem("bn_stats", (16, 35, 35, 288), "float16", layout="NHWC")
    cand = registry.get("bn_stats_channels_last")
    postproc = KnobsMatch(problem, SM90)
    kept = dropped = 0
    for replay in _replays(problem, cand, 24):
        name, knobs = registry.annotated_choice(replay, "bn_stats")
        built = cand.apply(prim_func(problem, cand.algorithm), SM90, knobs=knobs).mod
        same = tvm_ffi.structural_equal(replay.mod, built)
        assert postproc.apply(replay) == same, knobs
        kept, dropped = kept + same, dropped + (not same)
    assert kept and dropped


@pytest.mark.parametrize("op, shape, dtype, layout", [
    ("bn_stats", (64, 256, 56, 56), "float16", None), ("bn_stats", (16, 512, 28, 28), "bfloat16", None),
    ("bn_stats", (16, 35, 35, 288), "float16", "NHWC"), ("bn_forward", (256, 2048, 7, 7), "float16", None),
    ("bn_backward", (32, 14, 14, 1024), "bfloat16", "NHWC"), ("cross_entropy", (65536, 1000), "float16", None),
    ("cross_entropy", (16384, 50257), "bfloat16", None), ("cross_entropy_grad", (8192, 128256), "bfloat16", None),
])
def test_every_cuda_design_space_replays_with_other_knobs(op, shape, dtype, layout):
    """Every candidate's design space, replayed with 8 other samples of its knobs as the
    search does, applies without an error (one that did not failed a whole NHWC tune on
    the H200), and KnobsMatch keeps some of the replays."""
    from tvm_fusion import registry
    from tvm_fusion.tuner import KnobsMatch

    problem = tf.make_problem(op, shape, dtype, **({"layout": layout} if layout else {}))
    for cand in registry.applicable(problem, SM90):
        postproc = KnobsMatch(problem, SM90)
        kept = sum(postproc.apply(replay) for replay in _replays(problem, cand, 8))
        assert kept, cand.name


def test_tasks_are_made_without_parsing_the_tensor_intrinsics():
    """``ms.TuneContext`` imports ``tvm.s_tir.tensor_intrin`` (248 TVMScript parses,
    91 of a one-shape CPU tune's 106 s on the CI machine) for intrinsics these spaces
    never use. ``tasks_for`` makes its contexts without it, leaves no placeholder
    behind, and the real module still imports after."""
    code = (
        "import sys, tvm_fusion as tf\n"
        "from tvm_fusion.tuner import tasks_for, TENSOR_INTRINSICS\n"
        "from tvm_fusion import targets\n"
        "assert TENSOR_INTRINSICS not in sys.modules\n"
        "for op, shape in (('bn_stats', (8, 16, 14, 14)), ('cross_entropy', (64, 1000))):\n"
        "    assert tasks_for(tf.make_problem(op, shape, 'float32'), targets.resolve('llvm'))\n"
        "assert TENSOR_INTRINSICS not in sys.modules, 'parsed or left behind'\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec(TENSOR_INTRINSICS) is not None\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_bench_rows_append_with_the_csv_s_own_line_ends(tmp_path):
    """``bench.append_csv`` writes LF rows, as the rest of results/benchmarks.csv (csv's
    default is CRLF: 23 rows of one H200 run came back with CR before this), one line a
    row (a peer's error came in coloured lines), and reads back as written."""
    import csv

    from tvm_fusion import bench

    case = bench.Case("cross_entropy", (4, 10), "float32")
    rows = [bench.Result(case, "tvm_fusion api", 0.5, 10**6, "api loop", "ok"),
            bench.Result(case, "torch eager", None, 10**6, "",
                         "failed: DSLRuntimeError: \n\x1b[91m\x1b[1merror[INTERNAL]:\x1b[0m no IR\n   ")]
    path = tmp_path / "benchmarks.csv"
    bench.append_csv(rows, str(path), "cpu", 100.0, with_copy_row=True)
    bench.append_csv(rows[:1], str(path), "cpu", 100.0)
    data = path.read_bytes()
    assert b"\r" not in data and data.count(b"\n") == 5  # header, copy row, three results
    read = list(csv.DictReader(path.open()))
    assert [r["provider"] for r in read] == ["device copy", "tvm_fusion api", "torch eager", "tvm_fusion api"]
    assert read[1]["median_ms"] == "0.50000" and read[1]["gb_s"] == "2.0" and read[2]["median_ms"] == ""
    assert read[2]["status"] == "failed: DSLRuntimeError: error[INTERNAL]: no IR"


def test_the_results_csv_is_one_line_a_row_of_the_bench_s_fields():
    """Every row of results/benchmarks.csv has the bench's fields and no more (two rows of
    a probe once had an unquoted comma in the provider, which shifted every later field),
    and no field spans lines (a peer's coloured error once did)."""
    import csv

    from tvm_fusion import bench

    path = pathlib.Path(__file__).resolve().parents[1] / "results" / "benchmarks.csv"
    lines = path.read_text().splitlines()
    rows = list(csv.reader(lines))
    assert rows[0] == bench.CSV_FIELDS
    wrong = [i + 1 for i, row in enumerate(rows) if len(row) != len(bench.CSV_FIELDS)]
    assert not wrong, f"rows with another field count: {wrong[:10]}"
    assert len(rows) == len(lines), "a field spans lines"


def test_the_build_pool_works_from_a_script_with_no_main_guard(tmp_path):
    """The build pool's workers are fresh interpreters that never run the caller's
    script: a script that builds on it at its top level, with no ``if __name__ ==
    "__main__"`` guard, builds (a multiprocessing spawn pool re-ran such a script in
    every worker and broke at the first build, seen on the H200), and runs its top
    level once."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import tvm\n"
        "from tvm.s_tir import meta_schedule as ms\n"
        "from tvm_fusion import api, targets, tuner\n"
        "print('top level ran', flush=True)\n"
        "target = targets.resolve('llvm')\n"
        "problem = api.make_problem('cross_entropy', (16, 256), 'float32')\n"
        "pool = tuner.PoolBuilder(2)\n"
        "scheduled = tuner._scheduled(tuner.first_configs(problem, target, 1), target)\n"
        "with tvm.transform.PassContext(opt_level=3), target:\n"
        "    results = tuner.PooledBuilder(pool).build([ms.builder.BuilderInput(s.mod, target) for _, s in scheduled])\n"
        "pool.close()\n"
        "print('built', [(r.error_msg, bool(r.artifact_path)) for r in results], flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("top level ran") == 1
    assert "built [(None, True)" in done.stdout and "False)" not in done.stdout


# Shapes on which every registered candidate of the op applies to one at least (checked).
SEARCHED_SHAPES = {
    "bn_stats": [((8, 64, 16, 16), "float16", {}), ((8, 16, 16, 64), "bfloat16", {"layout": "NHWC"}),
                 ((2, 32, 256, 256), "float32", {}), ((256, 64, 2, 2), "float16", {}),
                 ((64, 2048, 7, 7), "float16", {})],
    "bn_forward": [((8, 64, 16, 16), "float16", {}), ((8, 16, 16, 64), "bfloat16", {"layout": "NHWC"}),
                   ((2, 32, 256, 256), "float32", {}), ((256, 64, 2, 2), "float16", {}),
                   ((64, 2048, 7, 7), "float16", {}), ((16, 8, 60, 60), "float32", {}),
                   ((16, 8, 64, 64), "float32", {}),
                   ((8, 64, 16, 16), "float16", {"training": False}),
                   ((8, 16, 16, 64), "bfloat16", {"layout": "NHWC", "training": False})],
    "bn_backward": [((8, 64, 16, 16), "float16", {}), ((8, 16, 16, 64), "bfloat16", {"layout": "NHWC"}),
                    ((2, 32, 256, 256), "float32", {}), ((256, 64, 2, 2), "float16", {}),
                    ((64, 2048, 7, 7), "float16", {}), ((16, 8, 64, 64), "float32", {})],
    "bn_backward_dx": [((8, 64, 16, 16), "float16", {}), ((8, 16, 16, 64), "bfloat16", {"layout": "NHWC"})],
    "cross_entropy": [((256, 32000), "float16", {}), ((8, 50257), "bfloat16", {}), ((4096, 128), "float16", {}),
                      ((64, 1000), "float32", {}), ((4, 256000), "bfloat16", {})],
    "cross_entropy_grad": [((256, 32000), "float16", {"mode": m}) for m in ("fused", "from_lse")]
    + [((8, 50257), "bfloat16", {"mode": m}) for m in ("fused", "from_lse")]
    + [((4096, 128), "float16", {"mode": m}) for m in ("fused", "from_lse")]
    + [((64, 1000), "float32", {"mode": "fused"}), ((4, 256000), "bfloat16", {"mode": "fused"})],
}


@pytest.mark.parametrize("op", sorted(SEARCHED_SHAPES))
def test_every_tunable_space_replays_after_metaschedules_trace_simplification(op):
    """MetaSchedule's evolutionary search replays a design space's trace after
    ``Trace.simplified(remove_postproc=True)``, which drops a GetSBlock whose output
    only a list input uses (``cache_read``'s ``consumer_blocks``): a candidate whose
    trace loses a random variable that way fails every tune it is in ("Random variable
    is not defined", the H200 tunes of cross_entropy_grad at c1333ff). Every
    candidate of the op, on CUDA and LLVM, on shapes where it applies."""
    covered = set()
    for target in (targets.with_limits(targets.resolve({"kind": "cuda", "arch": "sm_90"})), CPU):
        for shape, dtype, options in SEARCHED_SHAPES[op]:
            problem = tf.make_problem(op, shape, dtype, **options)
            for cand in registry.applicable(problem, target):
                func = prim_func(problem, cand.algorithm)
                sch = cand.apply(func, target, tunable=True)
                simplified = sch.trace.simplified(remove_postproc=True)
                fresh = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
                simplified.apply_to_schedule(fresh, remove_postproc=True)
                tvm.ir.assert_structural_equal(fresh.mod, sch.mod)
                covered.add(cand.name)
        names = {c.name for c in registry.candidates(op, target.kind.name)}
        assert names <= covered, f"no shape of the list applies to {sorted(names - covered)}"


def test_the_tuning_target_admits_a_row_kept_in_dynamic_shared_memory():
    """A gradient row of 50257 bf16 values kept on chip (100 KB of dynamic shared
    memory, which TVM opts into at launch) passes VerifyGPUCode on the tuning target
    (227 KB a block on sm_90): at the 48 KB of a block without opting in, every sample
    of such a candidate failed it and the search could not try one."""
    problem = tf.make_problem("cross_entropy_grad", (64, 50257), "bfloat16", mode="fused")
    cand = registry.get("cross_entropy_grad_window_in_shared")
    func = prim_func(problem, cand.algorithm)

    def verified(target):
        with tuner.no_tensor_intrinsics():  # 248 TVMScript parses a process otherwise (tuner's docstring)
            ctx = ms.TuneContext(tvm.IRModule({"main": func}), target=target,
                                 space_generator=ms.space_generator.ScheduleFn(lambda s: s, sch_rules=[], postprocs=[],
                                                                               mutator_probs={}), task_name="verify")
        postproc = ms.postproc.VerifyGPUCode()
        postproc._initialize_with_tune_context(ctx)
        return postproc.apply(cand.apply(func, target))

    tuning = targets.with_limits(targets.resolve({"kind": "cuda", "arch": "sm_90"}))
    assert tuning.attrs["max_shared_memory_per_block"] == 227 * 1024
    assert verified(tuning)
    assert not verified(SM90)  # 48 KB: the limit before


def test_a_log_of_records_through_our_reducers_opens_for_writing(tmp_path):
    """``records.json_database`` opens a log whose records' traces go through one of our
    reducers (registered with Python callbacks): TVM parses records on worker threads,
    and the constructor call held the GIL, so such a thread waited for it for good. The
    records are the H200's, from a gradient tune of 16384x50257 bf16 (its online
    candidate's six, RFactor through the targets pass's reducer), repeated so that
    worker threads take some: the next tune into that folder hung (2 tries of 2 with
    these 90 lines, before the fix)."""
    import lzma

    fixture = pathlib.Path(__file__).parent / "data" / "h200_gradient_records"
    folder = tmp_path / "log"
    folder.mkdir()
    (folder / records.WORKLOADS).write_bytes(lzma.decompress((fixture / (records.WORKLOADS + ".xz")).read_bytes()))
    lines = lzma.decompress((fixture / (records.RECORDS + ".xz")).read_bytes())
    (folder / records.RECORDS).write_bytes(lines * 15)
    code = ("import tvm_fusion.registry\nfrom tvm_fusion import records\n"
            f"print([len(records.json_database({str(folder)!r})) for _ in range(3)])")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("opening the log hung: a record parsed on a worker thread waits for the GIL")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[90, 90, 90]"
