"""Rebuilding a TIR statement around rewritten children, and collecting from one: TVM
0.27's Python has no statement mutator or visitor (``ir_transform``,
``post_order_visit``), so the build's rewrites (``launch_order``'s loop reversal,
``store_hints``' evict-first stores, ``granule_stores``, ``async_copy``) walk statements
with these."""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx


def map_children(stmt: tirx.Stmt, fn: Callable[[tirx.Stmt], tirx.Stmt]) -> tirx.Stmt:
    """``stmt`` with ``fn`` applied to each child statement of a container (``SeqStmt``,
    ``AttrStmt``, ``For``, ``IfThenElse``, ``While``); ``stmt`` itself where no child
    changed, and any other statement as it is."""
    if isinstance(stmt, tirx.SeqStmt):
        seq = [fn(s) for s in stmt.seq]
        return stmt if all(a.same_as(b) for a, b in zip(seq, stmt.seq)) else tirx.SeqStmt(seq)
    if isinstance(stmt, tirx.AttrStmt):
        body = fn(stmt.body)
        return stmt if body.same_as(stmt.body) else tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body)
    if isinstance(stmt, tirx.For):
        body = fn(stmt.body)
        return stmt if body.same_as(stmt.body) else tirx.For(
            stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.IfThenElse):
        then_case = fn(stmt.then_case)
        else_case = None if stmt.else_case is None else fn(stmt.else_case)
        if then_case.same_as(stmt.then_case) and (else_case is None or else_case.same_as(stmt.else_case)):
            return stmt
        return tirx.IfThenElse(stmt.condition, then_case, else_case)
    if isinstance(stmt, tirx.While):
        body = fn(stmt.body)
        return stmt if body.same_as(stmt.body) else tirx.While(stmt.condition, body)
    return stmt


def collect(stmt: tirx.Stmt, pick: Callable[[tirx.Stmt], object]) -> list:
    """Every value ``pick`` returns that is not None, over ``stmt`` and the statements
    under it (through the containers :func:`map_children` enters), in order; the
    statements under one that gave a value are not visited."""
    value = pick(stmt)
    if value is not None:
        return [value]
    found: list = []

    def visit(child: tirx.Stmt) -> tirx.Stmt:
        found.extend(collect(child, pick))
        return child
    map_children(stmt, visit)
    return found


def statements(stmt: tirx.Stmt) -> list:
    """``stmt``'s statements: a ``SeqStmt``'s, or ``stmt`` alone."""
    return list(stmt.seq) if isinstance(stmt, tirx.SeqStmt) else [stmt]


def seq(stmts: list) -> tirx.Stmt:
    """One statement of ``stmts``: a ``SeqStmt``, or the only one."""
    return tirx.SeqStmt(stmts) if len(stmts) > 1 else stmts[0]


def thread_attr(stmt: tirx.Stmt, prefix: str = "") -> bool:
    """Whether ``stmt`` is a launch's thread attribute whose tag starts with ``prefix``
    (``"blockIdx"``, ``"threadIdx"``; any with the default)."""
    return (isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent"
            and stmt.node.thread_tag.startswith(prefix))
