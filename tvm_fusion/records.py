"""Tuning logs: MetaSchedule's JSON database under ``tuning_logs/<target>/``.

The files are exactly what ``tvm.s_tir.meta_schedule.database.JSONDatabase`` reads
and writes (``database_workload.json``, ``database_tuning_record.json``, one JSON
value per line, appended a record at a time, so a tune that is killed keeps every
finished record). Reading goes through :func:`load`, which checks each line on its
own: a corrupt or truncated line is reported with its file and line number and the
other records still load.

A log that is only read (the cost model's training grids) may be kept compressed, as
``database_workload.json.xz`` and ``database_tuning_record.json.xz`` (or ``.gz``):
:func:`load` reads those where the plain files are absent, and ``unxz -k`` (``gunzip
-k``) gives back the files TVM's ``JSONDatabase`` reads. Writing into such a folder is
refused (a plain log beside the compressed one would split it); decompress it first.
xz, because a workload file repeats whole TIR modules farther apart than gzip's 32 KB
window reaches: the shipped grids' 9.6 MB of workloads are 1.12 MB gzipped and 137 KB
as xz (``xz -9e``).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import logging
import lzma
import os
import pathlib
from collections.abc import Callable

import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from . import targets

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
SHIPPED = pathlib.Path(__file__).resolve().parent.parent / "tuning_logs"
LOG_DIR_ENV = "TVM_FUSION_LOG_DIR"

log = logging.getLogger(__name__)


class LogLineError(ValueError):
    """A line of a tuning log that cannot be read."""

    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


@dataclasses.dataclass
class LoadedLog:
    database: ms.database.MemoryDatabase
    records: int
    problems: list[LogLineError]


def folder(log_dir: str | os.PathLike, target: Target) -> pathlib.Path:
    """``<log_dir>/<target key>``, e.g. ``tuning_logs/cuda_sm_90``."""
    return pathlib.Path(log_dir) / targets.key(target)


_JSON_DATABASE = tvm_ffi.get_global_func("s_tir.meta_schedule.DatabaseJSONDatabase")


# The compressed forms of a log file that are read (first found first), and how.
PACKED = {".xz": lzma.open, ".gz": gzip.open}


def holds_database(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a tuning-record file, plain or compressed."""
    file = pathlib.Path(path) / RECORDS
    return file.exists() or _packed(file) is not None


def _packed(path: pathlib.Path) -> pathlib.Path | None:
    """The compressed form of ``path`` that exists (``.xz`` before ``.gz``), if any."""
    for suffix in PACKED:
        packed = path.with_name(path.name + suffix)
        if packed.exists():
            return packed
    return None


def json_database(path: str | os.PathLike) -> ms.database.JSONDatabase:
    """The MetaSchedule JSON database in ``path`` (created if missing)."""
    packed = [p for p in (_packed(pathlib.Path(path) / name) for name in (WORKLOADS, RECORDS)) if p is not None]
    if packed:
        raise ValueError(f"{path} holds a compressed log ({', '.join(p.name for p in packed)}), which is only read: "
                         f"decompress it (unxz -k or gunzip -k, then remove the compressed files) before writing "
                         f"records there")
    os.makedirs(path, exist_ok=True)
    # Not ms.database.JSONDatabase(...): tvm-ffi makes an object's constructor call with
    # the GIL held, and TVM parses the records on worker threads, each replaying its
    # trace; a trace through one of our reducers calls back into Python for it
    # (compute.primitives), so that thread waits for the GIL for good. A log holding
    # such records (the H200's 16384x50257 bf16 gradient tune) hung the next tune into
    # its folder. The same constructor called as a function releases the GIL.
    return _JSON_DATABASE(os.path.join(path, WORKLOADS), os.path.join(path, RECORDS), True, "structural")


def _read_lines(path: pathlib.Path):
    """(line number, line) of ``path``'s non-blank lines; of its compressed form where
    only that exists."""
    packed = None if path.exists() else _packed(path)
    if path.exists():
        handle = open(path)
    elif packed is not None:
        handle = PACKED[packed.suffix](packed, "rt")
    else:
        return
    with handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


def load(path: str | os.PathLike, strict: bool = False) -> LoadedLog:
    """Read a log folder line by line into an in-memory database, every record in the
    order it was written.

    Bad lines are collected in ``problems`` (and logged); with ``strict`` the first
    one raises :class:`LogLineError`."""
    problems: list[LogLineError] = []

    def bad(err: LogLineError) -> None:
        if strict:
            raise err
        log.warning("skipping %s", err)
        problems.append(err)

    indexed = IndexedLog(path, bad)
    return LoadedLog(indexed.database, indexed.parse(), problems)


def merge(sources: list[str | os.PathLike], destination: str | os.PathLike) -> int:
    """Append every readable record of ``sources`` to the log in ``destination``;
    returns how many were written. Bad lines are reported, not copied."""
    out = json_database(destination)
    written = 0
    for source in sources:
        loaded = load(source)
        for record in loaded.database.get_all_tuning_records():
            workload = out.commit_workload(record.workload.mod)
            out.commit_tuning_record(
                ms.database.TuningRecord(record.trace, workload, record.run_secs, record.target, record.args_info)
            )
            written += 1
    invalidate()
    return written


def compact(folder: str | os.PathLike) -> int:
    """Rewrite the workload file of the database in ``folder`` with its modules' JSON
    unindented: MetaSchedule stores each workload as base64 of a length-prefixed,
    2-space-indented JSON graph, half of it whitespace (83 KB a cross entropy problem).
    TVM reads the compact form the same way (the test loads both and compares). Returns
    the bytes saved."""
    import base64
    import struct

    path = pathlib.Path(folder) / WORKLOADS
    before = path.read_bytes()
    lines = []
    for line in before.decode().splitlines():
        if not line.strip():
            continue
        shash, encoded = json.loads(line)
        raw = base64.b64decode(encoded)
        (length,) = struct.unpack("<Q", raw[:8])
        graph = json.dumps(json.loads(raw[8:8 + length]), separators=(",", ":")).encode()
        lines.append(json.dumps([shash, base64.b64encode(struct.pack("<Q", len(graph)) + graph).decode()]))
    after = ("\n".join(lines) + "\n").encode() if lines else b""
    path.write_bytes(after)
    invalidate()
    return len(before) - len(after)


_CACHES: list[dict] = []


def register_cache(cache: dict) -> dict:
    """Have ``cache`` (a choice, kernel or launcher cache keyed by problem) cleared
    whenever a log changes in this process; returns it."""
    _CACHES.append(cache)
    return cache


def invalidate() -> None:
    """Forget every cached reading of the logs: call after writing records (``tune``
    and :func:`merge` do) or after changing logs from outside this process.
    Dispatch reads no file per call, so without this a change goes unseen."""
    _cached.cache_clear()
    _rejected_in.cache_clear()
    for cache in _CACHES:
        cache.clear()


REJECTED = "rejected.json"  # configurations whose kernels gave wrong outputs (tvm_fusion.verify)


def reject(path: str | os.PathLike, problem_key: str, candidate: str, knobs: str, reason: str) -> None:
    """Record in the log folder ``path`` that ``candidate`` at ``knobs`` gave wrong
    outputs on ``problem_key``: dispatch skips its records (:func:`rejected`) in every
    folder it searches. The tuner's check writes it (``tuner.tune``)."""
    file = pathlib.Path(path) / REJECTED
    entries = json.loads(file.read_text())["rejected"] if file.exists() else []
    entry = {"problem": problem_key, "candidate": candidate, "knobs": knobs, "reason": reason}
    if not any(e["problem"] == problem_key and e["candidate"] == candidate and e["knobs"] == knobs for e in entries):
        entries.append(entry)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"rejected": entries}, indent=1) + "\n")
    invalidate()


def rejected(log_dir: str | os.PathLike | None, target: Target) -> frozenset[tuple[str, str, str]]:
    """(problem key, candidate, knobs as text) of every configuration rejected in the
    folders dispatch searches for ``target``."""
    found = set()
    for base in search_paths(log_dir):
        file = folder(base, target) / REJECTED
        if file.exists():
            found |= _rejected_in(str(file), file.stat().st_mtime)
    return frozenset(found)


@functools.lru_cache(maxsize=16)
def _rejected_in(path: str, mtime: float) -> frozenset[tuple[str, str, str]]:
    try:
        entries = json.loads(pathlib.Path(path).read_text())["rejected"]
        return frozenset((e["problem"], e["candidate"], e["knobs"]) for e in entries)
    except (ValueError, KeyError, TypeError) as err:
        raise LogLineError(path, 1, f"not a list of rejected configurations ({_short(err)})") from err


def search_paths(log_dir: str | os.PathLike | None) -> list[pathlib.Path]:
    """Where dispatch looks: the given folder, ``$TVM_FUSION_LOG_DIR``, the shipped logs."""
    paths = [pathlib.Path(p) for p in (log_dir, os.environ.get(LOG_DIR_ENV)) if p]
    return paths + [SHIPPED]


class IndexedLog:
    """A log folder as dispatch reads it: every workload at once, a workload's records
    the first time :meth:`database_for` is asked for it. Parsing the records' traces is
    most of a :func:`load` (the 289 records of the shipped H200 log: 2.5 s of 2.6 s on
    the 2-core CI machine, paid by each process's first CUDA call), and a process asks
    for a few workloads. A line that cannot be read goes to ``bad`` (by default it is
    logged): the workloads and the records' JSON at once, a record's trace when it is
    parsed."""

    def __init__(self, path: str | os.PathLike, bad: Callable[[LogLineError], None] | None = None):
        self.path = pathlib.Path(path)
        self.database = ms.database.MemoryDatabase()
        self._bad = bad or (lambda err: log.warning("skipping %s", err))
        self._workloads: list[ms.database.Workload | None] = []  # by line, as the database holds it
        self._pending: list[tuple[int, int, object]] = []  # (record line, workload line, its JSON)
        for number, line in _read_lines(self.path / WORKLOADS):
            try:
                workload = ms.database.Workload.from_json(json.loads(line))
            except Exception as err:  # noqa: BLE001 - any unreadable line is reported alike
                self._report(WORKLOADS, number, f"not a workload ({_short(err)})")
                self._workloads.append(None)
                continue
            self._workloads.append(self.database.commit_workload(workload.mod))
        for number, line in _read_lines(self.path / RECORDS):
            try:
                entry = json.loads(line)
                index = int(entry[0])
                if not 0 <= index < len(self._workloads) or self._workloads[index] is None:
                    raise ValueError(f"refers to unreadable workload #{index}")
            except Exception as err:  # noqa: BLE001
                self._report(RECORDS, number, f"not a tuning record ({_short(err)})")
                continue
            self._pending.append((number, index, entry[1]))

    @property
    def workloads(self) -> list[ms.database.Workload]:
        """The log's readable workloads, in the order of its file (no trace parsed)."""
        return [workload for workload in self._workloads if workload is not None]

    def parse(self, keep: Callable[[ms.database.Workload], bool] | None = None) -> int:
        """Parse the records not yet parsed (of the workloads ``keep`` accepts, when
        given: asked once a workload) into :attr:`database`, in the order they were
        written; returns how many were read."""
        wanted = list(self.raw(keep))
        taken = {number for number, _, _ in wanted}
        self._pending = [pending for pending in self._pending if pending[0] not in taken]
        count = 0
        for number, workload, entry in wanted:
            record = self.parse_one(number, workload, entry)
            if record is not None:
                self.database.commit_tuning_record(record)
                count += 1
        return count

    def raw(self, keep: Callable[[ms.database.Workload], bool] | None = None):
        """``(line number, workload, record JSON)`` of each record not parsed yet (of
        the workloads ``keep`` accepts, asked once a workload), in the order written,
        its trace left as JSON: for a reader that needs a record's JSON only
        (``cost_model.training_rows``). Parse one with :meth:`parse_one`."""
        kept: dict[int, bool] = {}
        for number, index, entry in self._pending:
            if index not in kept:
                kept[index] = keep is None or keep(self._workloads[index])
            if kept[index]:
                yield number, self._workloads[index], entry

    def parse_one(self, number: int, workload: ms.database.Workload, entry: object) -> ms.database.TuningRecord | None:
        """The record of line ``number`` (as :meth:`raw` gave it) parsed, or None,
        reported, when it cannot be."""
        try:
            return ms.database.TuningRecord.from_json(entry, workload)
        except Exception as err:  # noqa: BLE001
            self._report(RECORDS, number, f"not a tuning record ({_short(err)})")
            return None

    def database_for(self, mod) -> ms.database.MemoryDatabase | None:
        """The in-memory database with every readable record of ``mod``'s workload, or
        None when the log has no such workload."""
        if not self.database.has_workload(mod):
            return None
        workload = self.database.commit_workload(mod)
        self.parse(workload.same_as)
        return self.database

    def _report(self, name: str, number: int, reason: str) -> None:
        self._bad(LogLineError(str(self.path / name), number, reason))


@functools.lru_cache(maxsize=16)
def _cached(path: str, mtime: float) -> IndexedLog:
    return IndexedLog(path)


def databases(log_dir: str | os.PathLike | None, target: Target) -> list[tuple[pathlib.Path, IndexedLog]]:
    """The log folders dispatch searches (:func:`search_paths`) that hold a log for
    ``target``, each read once a process (until :func:`invalidate`)."""
    found = []
    for base in search_paths(log_dir):
        path = folder(base, target)
        records = path / RECORDS
        if records.exists():
            found.append((path, _cached(str(path), records.stat().st_mtime)))
    return found


def _short(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[-1][:160] if text else type(err).__name__


def curve(path: str | os.PathLike) -> dict[str, list[float]]:
    """Per workload (by its task's problem key when tagged), the median run time of
    each record in the order the records were written: the tuning curve."""
    loaded = load(path)
    curves: dict[str, list[float]] = {}
    for record in loaded.database.get_all_tuning_records():
        if not record.run_secs:
            continue
        func = record.workload.mod["main"]
        name = str(func.attrs["tvm_fusion.problem"]) if "tvm_fusion.problem" in func.attrs else "workload"
        if "tvm_fusion.algorithm" in func.attrs:
            name = _key(name) + ":" + str(func.attrs["tvm_fusion.algorithm"])
        secs = sorted(float(s) for s in record.run_secs)
        curves.setdefault(name, []).append(secs[len(secs) // 2])
    return curves


def _key(problem_json: str) -> str:
    from .compute import problem_from_json

    return problem_from_json(problem_json).key()


def plot_curves(path: str | os.PathLike) -> list[str]:
    """One PNG per task beside the log: best time so far against trials."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, times in curve(path).items():
        best, so_far = [], float("inf")
        for t in times:
            so_far = min(so_far, t)
            best.append(so_far * 1e3)
        fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
        ax.plot(range(1, len(best) + 1), best, marker=".")
        ax.set_xlabel("trials")
        ax.set_ylabel("best time so far (ms)")
        ax.set_title(name, fontsize=8)
        fig.tight_layout()
        out = pathlib.Path(path) / f"curve_{name.replace(':', '_')}.png"
        fig.savefig(out)
        plt.close(fig)
        written.append(str(out))
    return written
