"""Algorithm level of cross_entropy: row reductions, a scalar transform, a batch reduction.

Decompositions of the per-row log-sum-exp, as TE compute:

``three_pass``  ``x(SR) -> max(S) -> exp, sum(S) -> row_loss(S) -> batch(R)``
    1. row_max[i]    = max_k x[i, k]
    2. row_sumexp[i] = sum_k exp(x[i, k] - row_max[i])   (+ sum_k w_k x[i, k] with smoothing)
    3. row_loss[i]   = (1 - eps) w[t_i] (lse_i - x[i, t_i]) + eps / V (W lse_i - z_i)
``online``      ``x(SRR) -> chunk max, sumexp (SS) -> (max, sumexp)(S) -> row_loss(S) -> batch(R)``
    one pass over the row in 16-byte chunks (c values: 8 for 16-bit, 4 for float32):
    1. chunk_max[i, j]    = max_v x[i, c j + v]
    2. chunk_sumexp[i, j] = sum_v exp(x[i, c j + v] - chunk_max[i, j])
    3. (row_max, row_sumexp)[i] = online_logsumexp_j (chunk_max, chunk_sumexp)[i, j]:
       running max with the sum rescaled once per chunk, 1 + 2/c exp per element.
    4. row_loss as above.
``three_pass_poly_exp``  ``three_pass`` with exp as a polynomial after range
    reduction (``poly_exp``), for targets whose vector units have no exp (LLVM).
    Where V is not a multiple of 4, steps 1 and 2 run over the row's body (its first
    V - V mod 16 classes, which vector lanes split evenly) and its tail apart
    (``poly_exp_body``):
    1. row_max_body[i] = max_{k < b} x[i, k];  row_max[i] = max_{b <= k < V} max(x[i, k], row_max_body[i])
    2. row_sumexp[i] = row_sumexp_body[i] + row_sumexp_tail[i]  (each as in 2., smoothing sums too:
       ``poly_exp_joins``)
``aligned_online``  ``x(SRR) -> granule (max, sumexp)(SS) -> (max, sumexp)(S) + edges(S) -> row_loss(S) -> batch(R)``
    ``online`` over the 16-byte granules of the flat logits, for rows whose byte
    length is not a multiple of 16 (row i starts at element iV, off the 16-byte grid
    for all rows but one in c). With a_i = (iV) mod c (the row's start in its granule)
    and n = floor(V / c) - 1 body granules (the fewest any residue leaves inside the
    row, so the index space is rectangular; V >= 2c):
    1. chunk_max[i, j]    = max_v x[i, col(i, j, v)],  col = c floor(iV/c) - iV + c (min(j, n-1) + 1) + v
       (= c (j + 1) - a_i + v; written so the flat index iV + col is visibly a multiple
       of c plus v, which TVM's CUDA codegen needs to emit one 16-byte load; the
       clamp is a no-op here and lets a schedule's ragged split load unguarded)
    2. chunk_sumexp[i, j] = sum_v exp(x[i, col] - chunk_max[i, j])   (+ smoothing sums)
    3. (row_online sumexp, max)[i] = online_logsumexp_j over the n granules
    4. edges, e in [0, 3c - 2): e < c the head's granule (element e - a_i, inside when
       e >= a_i), else the tail (element c n + e - a_i, inside when < V):
       edge_max[i] = max_e x_e,  edge_sumexp[i] = sum_e exp(x_e - edge_max[i])   (+ smoothing sums)
    5. the join: row_max = max(m_b, m_e), row_sumexp = s_b e^(m_b - row_max) + s_e e^(m_e - row_max),
       row_extra{n} = body + edge smoothing sums; then row_loss as above.
    Same float32 numerics as ``online``; a schedule lays each granule's register stage
    out by the flat granules ((iV + k) / c, (iV + k) mod c) so its c values sit at
    constant register indices (schedules/cuda/cross_entropy_aligned_rows.py).
``padded_three_pass``  ``x(SRR) -> max(S) -> exp, sum(S) -> row_loss(S) -> batch(R)``
    ``three_pass`` over the row's G = V / c granules padded to a multiple of a warp's
    32 lanes, Gp (V a multiple of c, rows 16-byte aligned): the reductions run over
    (g, v) in [0, Gp) x [0, c), granule g read at min(g, G - 1), its values masked
    by a select where g >= G (-inf for the max, 0 for the sums).
    0. granules[i, g, v] = x[i, c min(g, G-1) + v]     (a map a schedule inlines)
    1. row_max[i]    = max_{g,v} (g < G ? granules[i, g, v] : -inf)
    2. row_sumexp[i] = sum_{g,v} exp((g < G ? granules[i, g, v] : -inf) - row_max[i])
    The padded domain splits evenly over 32 lanes, so a lane's loads carry no guard:
    ``three_pass`` split the same way gives every load of the last step a bounds
    branch, and nvcc then issued a lane's 16-byte loads one at a time (the SASS of
    ``cross_entropy_warp_per_row`` on 65536x1000 fp16: four LDG.128 per pass, each
    behind its own branch). Same float32 numerics as ``three_pass``.

``split_online``  ``online`` over the row's chunks padded to a multiple of ``SPLIT_GRAIN``
    (64): the padded chunks' values are all masked (-inf), so a padded chunk is
    (lowest, 0), the online reducer's identity. Any split of the chunks into 2 to 64
    parts (a power of two) is then exact, and a schedule that cuts each row's online
    pass over blocks with an rfactor keeps one guard, the lanes' step within a part.
    With the row's end guarded too, TVM's iterator-map detection no longer took the
    partial block for a reduction, and the cross-thread reduction was never lowered
    (schedules/cuda/cross_entropy_split_row.py). Same float32 numerics as ``online``.

Then the batch stage (not for reduction="none"):
    4. (total, denom, first_bad) = (sum_i row_loss[i], sum_i w[t_i] [t_i valid], min bad row)
    5. loss = total / denom (mean) or total (sum)

``first_bad_row`` (1,) holds the first row whose target is outside [0, V) and not
ignore_index, or B when there is none. The gather ``x[i, t_i]`` reads a clamped index,
so a bad target is flagged, never read out of bounds.

The PrimFunc's parameters are ``logits, target[, weight]`` then, for reduction="none",
``loss (B,), first_bad_row (1,)``; otherwise ``row_loss (B,), loss (1,), first_bad_row (1,)``.

The steps are module functions (``row_statistics``, ``target_checks``, ``row_loss_value``,
``bad_row_value``, ``row_weight_value``, ``batch_stage``) that the gradient (``compute.cross_entropy_grad``)
builds from too; the forward's PrimFuncs are structurally what they were before that
split, so tuning records keep matching.
"""

from __future__ import annotations

from tvm import te, tirx

from ..contracts.common import DTYPE_BYTES
from ..contracts.cross_entropy import CrossEntropyProblem
from .primitives import (
    BATCH_SUMS,
    DUAL_SUM,
    ONLINE_LSE,
    TRIPLE_SUM,
    dims,
    granule,
    index_dtype,
    logsumexp,
    poly_exp,
    widen,
)

ALGORITHMS = ("three_pass", "online", "three_pass_poly_exp", "aligned_online", "padded_three_pass", "split_online")
PAD_LANES = 32  # padded_three_pass pads a row's granules to a multiple of a warp's lanes
SPLIT_GRAIN = 64  # split_online pads a row's chunks to a multiple of this many (parts)


def placeholders(problem, idx: str) -> tuple[te.Tensor, te.Tensor, te.Tensor | None]:
    """``logits`` (B, V), ``target`` (B,) and, with a weight, ``weight`` (V,) float32."""
    batch, classes = dims(problem.shape, idx)
    logits = te.placeholder((batch, classes), problem.dtype, name="logits")
    target = te.placeholder((batch,), problem.target_dtype, name="target")
    weight = te.placeholder((classes,), "float32", name="weight") if problem.has_weight else None
    return logits, target, weight


def row_statistics(problem, logits: te.Tensor, weight: te.Tensor | None, algorithm: str, idx: str) -> tuple:
    """Steps 1-2 (or the online 1-3) of ``algorithm``: ``(row_max, row_sumexp, extra)``,
    ``extra`` the smoothing sums ``[sum_k w_k x_ik, sum_k w_k]`` (``[sum_k x_ik]``
    without weight; ``[]`` without smoothing). ``problem`` is a cross entropy problem
    or its gradient's (the fields read are the same)."""
    batch, classes = dims(problem.shape, idx)
    rows = [batch]
    smoothing = problem.label_smoothing > 0.0
    weighted = problem.has_weight

    def x(i, k):
        return widen(logits[i, k], problem.dtype)

    k = te.reduce_axis((tirx.IntImm(idx, 0), classes), name="k")
    # 1-2. Per-row statistics: max, sum of exp, and the smoothing sums when needed.
    def smooth_terms(i, kk) -> tuple:
        if not smoothing:
            return ()
        if weighted:
            return (weight[kk] * x(i, kk), weight[kk])
        return (x(i, kk),)

    if algorithm == "aligned_online":
        return aligned_row_statistics(problem, logits, weight, idx)
    if algorithm == "padded_three_pass":
        return padded_row_statistics(problem, logits, weight, idx)
    exp = poly_exp if algorithm == "three_pass_poly_exp" else te.exp

    def sums(i, axis):
        return sum_terms((exp(x(i, axis) - row_max[i]),) + smooth_terms(i, axis), axis)

    def as_list(stats):
        return list(stats) if isinstance(stats, (list, tuple)) else [stats]

    if algorithm in ("three_pass", "three_pass_poly_exp"):
        body = poly_exp_body(problem.classes) if algorithm == "three_pass_poly_exp" else problem.classes
        if body == problem.classes:
            row_max = te.compute(rows, lambda i: te.max(x(i, k), axis=k), name="row_max")
            k2 = te.reduce_axis((tirx.IntImm(idx, 0), classes), name="k2")
            row_sumexp, *extra = as_list(te.compute(rows, lambda i: sums(i, k2), name="row_sumexp"))
        else:  # the row's body (vector lanes split it evenly) and its tail, reduced apart, then joined
            kb = te.reduce_axis((tirx.IntImm(idx, 0), tirx.IntImm(idx, body)), name="k")
            kt = te.reduce_axis((tirx.IntImm(idx, body), classes), name="kt")
            max_body = te.compute(rows, lambda i: te.max(x(i, kb), axis=kb), name="row_max_body")
            row_max = te.compute(rows, lambda i: te.max(tirx.max(x(i, kt), max_body[i]), axis=kt), name="row_max")
            kb2 = te.reduce_axis((tirx.IntImm(idx, 0), tirx.IntImm(idx, body)), name="k2")
            kt2 = te.reduce_axis((tirx.IntImm(idx, body), classes), name="kt2")
            body_stats = as_list(te.compute(rows, lambda i: sums(i, kb2), name="row_sumexp_body"))
            tail_stats = as_list(te.compute(rows, lambda i: sums(i, kt2), name="row_sumexp_tail"))

            def join(b, t, name):
                return te.compute(rows, lambda i: b[i] + t[i], name=name)

            row_sumexp, *extra = [join(b, t, name)
                                  for b, t, name in zip(body_stats, tail_stats, poly_exp_joins(problem))]
    else:
        # Online over 16-byte chunks: the chunk's max and its exps first (in
        # registers), then one rescale per chunk: 1 + 2/chunk exp per element.
        chunk = 16 // DTYPE_BYTES[problem.dtype]
        chunks = (problem.classes + chunk - 1) // chunk
        if algorithm == "split_online":
            chunks = -(-chunks // SPLIT_GRAIN) * SPLIT_GRAIN
        ragged = chunks * chunk != problem.classes

        def col(j, vv):
            return j * tirx.IntImm(idx, chunk) + vv

        def xv(i, j, vv):
            if not ragged:
                return x(i, col(j, vv))
            inside = col(j, vv) < classes
            return tirx.if_then_else(inside, x(i, col(j, vv)), tirx.const(-float("inf"), "float32"))

        def extras(i, j, vv):
            terms = smooth_terms(i, col(j, vv))
            if not ragged:
                return terms
            inside = col(j, vv) < classes
            return tuple(tirx.if_then_else(inside, term, tirx.const(0.0, "float32")) for term in terms)

        stats = online_chunk_statistics([batch, tirx.IntImm(idx, chunks)], chunk, idx, xv, extras)
        row_sumexp, row_max, extra = stats[0], stats[1], list(stats[2:])

    return row_max, row_sumexp, extra


POLY_EXP_GRAIN = 16  # the widest vector of float32 lanes that always splits a row's body evenly


def poly_exp_body(classes: int) -> int:
    """``three_pass_poly_exp``'s body: the classes that vector lanes reduce. All of them
    where V is a multiple of 4 (4, 8, 16 or 32 lanes divide it) or under 16; else the
    first ``V - V mod 16``, and the last ``V mod 16`` are the row's tail, reduced
    on their own and joined (``row_max_body``, ``row_sumexp_body``,
    ``row_sumexp_tail`` then ``row_max`` and the joins, ``poly_exp_joins``). One accumulator over a
    whole odd row drifted: 1.5e-4 off the log-sum-exp of a 50257-class float32 row,
    where 16 lanes stay within 1e-5 (tests/test_cpu.py)."""
    if classes % 4 == 0 or classes < POLY_EXP_GRAIN:
        return classes
    return classes - classes % POLY_EXP_GRAIN


def online_chunk_statistics(row_chunks: list, chunk: int, idx: str, value, extras, name: str = "row_online") -> list:
    """The online statistics over 16-byte chunks, ``[sum of exp, max, *extras' sums]``
    per row (block ``name``): each chunk's max (``chunk_max``) and its sum of exp
    against it with the extras' sums (``chunk_sumexp``) over its ``chunk`` values, in
    registers, then the chunks folded by the online rule (``ONLINE_LSE``): 1 + 2 /
    chunk exps an element. ``row_chunks``: (rows, chunks); ``value(i, j, v)``: value v
    of chunk j of row i, widened, -inf where masked; ``extras(i, j, v)``: its smoothing
    terms, a tuple (0 where masked)."""
    zero = tirx.IntImm(idx, 0)
    v = te.reduce_axis((zero, tirx.IntImm(idx, chunk)), name="v")
    v2 = te.reduce_axis((zero, tirx.IntImm(idx, chunk)), name="v2")
    chunk_max = te.compute(row_chunks, lambda i, j: te.max(value(i, j, v), axis=v), name="chunk_max")
    chunk_stats = te.compute(
        row_chunks,
        lambda i, j: sum_terms((te.exp(value(i, j, v2) - chunk_max[i, j]),) + extras(i, j, v2), v2),
        name="chunk_sumexp")
    chunk_stats = chunk_stats if isinstance(chunk_stats, (list, tuple)) else [chunk_stats]
    j = te.reduce_axis((zero, row_chunks[1]), name="j")
    stats = te.compute(row_chunks[:1], lambda i: ONLINE_LSE[len(chunk_stats) - 1](
        (chunk_stats[0][i, j], chunk_max[i, j]) + tuple(t[i, j] for t in chunk_stats[1:]), axis=j), name=name)
    return list(stats)


def sum_terms(terms: tuple, axis) -> te.Tensor | tuple:
    """One reduction over ``axis`` of the sum of exp and its smoothing sums (one, two or
    three terms): ``te.sum``, or the pair or triple of sums that one block computes."""
    if len(terms) == 1:
        return te.sum(terms[0], axis=axis)
    return (DUAL_SUM if len(terms) == 2 else TRIPLE_SUM)(terms, axis=axis)


def poly_exp_joins(problem) -> list[str]:
    """The blocks that join a ragged row's body and tail sums (``poly_exp_body``):
    ``row_sumexp`` and one per smoothing sum. Maps a schedule inlines."""
    return ["row_sumexp"] + [f"row_sumexp_extra{n}" for n in range(1, smoothing_sums(problem) + 1)]


def smoothing_sums(problem) -> int:
    """The row sums label smoothing adds beside the sum of exp: sum_k w_k x_ik and
    sum_k w_k with weight, sum_k x_ik without, none without smoothing."""
    return (2 if problem.has_weight else 1) if problem.label_smoothing > 0.0 else 0


def padded_granules(problem) -> tuple[int, int]:
    """``padded_three_pass``'s (G, Gp): the row's 16-byte granules and their count
    padded to a multiple of ``PAD_LANES``; a ValueError where V is not a multiple of
    a granule's elements (a row not on the 16-byte grid: ``aligned_online``'s case)."""
    c = granule(problem.dtype)
    if problem.classes % c:
        raise ValueError(f"cross_entropy: padded_three_pass needs V a multiple of {c} for {problem.dtype}, "
                         f"got V = {problem.classes}")
    granules = problem.classes // c
    return granules, -(-granules // PAD_LANES) * PAD_LANES


def padded_row_statistics(problem, logits: te.Tensor, weight: te.Tensor | None, idx: str) -> tuple:
    """``padded_three_pass``'s ``(row_max, row_sumexp, extra)`` (as :func:`row_statistics`).

    The padded row is a map of its own, ``granules[i, g, v]`` (B, Gp, c), that a
    schedule inlines into its register stages: a stage of ``granules`` at one granule
    is one granule exactly, where a stage of ``logits`` behind the clamp (not affine)
    got a bound check back from the region analysis."""
    batch, _ = dims(problem.shape, idx)
    rows = [batch]
    c = granule(problem.dtype)
    count, padded = padded_granules(problem)
    C, last = tirx.IntImm(idx, c), tirx.IntImm(idx, count - 1)
    smoothing = problem.label_smoothing > 0.0

    def col(g, v):  # granule g, clamped into the row: always a whole aligned granule
        return tirx.min(g, last) * C + v

    granules = te.compute([batch, tirx.IntImm(idx, padded), C], lambda i, g, v: logits[i, col(g, v)],
                          name="granules")

    def x(i, g, v):
        return widen(granules[i, g, v], problem.dtype)

    def masked(g, value, pad):
        return tirx.Select(g < tirx.IntImm(idx, count), value, tirx.const(pad, "float32"))

    def axes(suffix):
        return (te.reduce_axis((tirx.IntImm(idx, 0), tirx.IntImm(idx, padded)), name=f"g{suffix}"),
                te.reduce_axis((tirx.IntImm(idx, 0), C), name=f"v{suffix}"))

    g, v = axes("")
    row_max = te.compute(rows, lambda i: te.max(masked(g, x(i, g, v), -float("inf")), axis=[g, v]), name="row_max")
    g2, v2 = axes("2")

    def sumexp_body(i):
        # exp(-inf - max) = 0 on a pad: no select after the exp, whose guard nvcc
        # compiled as a branch around each MUFU.EX2
        terms = (te.exp(masked(g2, x(i, g2, v2), -float("inf")) - row_max[i]),)
        if smoothing:
            k = col(g2, v2)
            plain = (weight[k] * x(i, g2, v2), weight[k]) if problem.has_weight else (x(i, g2, v2),)
            terms += tuple(masked(g2, t, 0.0) for t in plain)
        return sum_terms(terms, [g2, v2])

    stats = te.compute(rows, sumexp_body, name="row_sumexp")
    stats = stats if isinstance(stats, (list, tuple)) else [stats]
    return row_max, stats[0], list(stats[1:])


def aligned_row_statistics(problem, logits: te.Tensor, weight: te.Tensor | None, idx: str) -> tuple:
    """``aligned_online``'s ``(row_max, row_sumexp, extra)`` (as :func:`row_statistics`) from
    the aligned body granules (``chunk_max``, ``chunk_sumexp``, ``row_online``) and the
    head and tail (``edge_max``, ``edge_sumexp``), combined by one online step."""
    batch, classes = dims(problem.shape, idx)
    rows = [batch]
    c = granule(problem.dtype)
    V = problem.classes
    body = V // c - 1
    if body < 1:
        raise ValueError(f"cross_entropy: aligned_online needs V >= {2 * c} for {problem.dtype}, got V = {V}")
    edge = c + 2 * c - 2  # the head's granule, then at most 2c - 2 tail elements
    smoothing = problem.label_smoothing > 0.0
    weighted = problem.has_weight
    n_extra = smoothing_sums(problem)
    C = tirx.IntImm(idx, c)

    def x(i, k):
        return widen(logits[i, k], problem.dtype)

    def offset(i):  # a_i: the row's start within its 16-byte granule
        return tirx.floormod(i * classes, C)

    def smooth_terms(i, k, inside=None) -> tuple:
        if not smoothing:
            return ()
        terms = (weight[k] * x(i, k), weight[k]) if weighted else (x(i, k),)
        if inside is None:
            return terms
        return tuple(tirx.if_then_else(inside, t, tirx.const(0.0, "float32")) for t in terms)

    # Body: granule j + 1 of the row's window, always inside the row, no guard. The
    # granule index is clamped to the body (a no-op for j < body): the lanes' split
    # of the body is ragged, and without the clamp the register stage of a granule
    # cannot be proven inside the row, gets a per-element bound and loses its
    # 16-byte load.
    last = tirx.IntImm(idx, body - 1)

    def col(i, j, vv):
        # c floor(iV / c) - iV, not -a_i: the flat index iV + col then simplifies to
        # c (floor(iV / c) + j + 1) + v, a multiple of c plus the lane, which TVM's
        # CUDA codegen must see (a modular-set check) to emit one 16-byte load.
        start = tirx.floordiv(i * classes, C) * C - i * classes
        return start + (tirx.min(j, last) + tirx.IntImm(idx, 1)) * C + vv

    online = online_chunk_statistics([batch, tirx.IntImm(idx, body)], c, idx,
                                     lambda i, j, vv: x(i, col(i, j, vv)),
                                     lambda i, j, vv: smooth_terms(i, col(i, j, vv)))

    # Edges: e < c is the head's granule (element e - a_i, inside when e >= a_i), the
    # rest the tail (element c * body + e - a_i, inside when below V).
    def edge_col(i, e):
        head = e < C
        k = tirx.Select(head, e, tirx.IntImm(idx, c * body) + e) - offset(i)
        inside = tirx.Select(head, e >= offset(i), k < classes)
        return k, inside

    def edge_x(i, e, pad):
        k, inside = edge_col(i, e)
        return tirx.if_then_else(inside, x(i, k), tirx.const(pad, "float32")), k, inside

    e1 = te.reduce_axis((tirx.IntImm(idx, 0), tirx.IntImm(idx, edge)), name="e1")
    e2 = te.reduce_axis((tirx.IntImm(idx, 0), tirx.IntImm(idx, edge)), name="e2")
    edge_max = te.compute(rows, lambda i: te.max(edge_x(i, e1, -float("inf"))[0], axis=e1), name="edge_max")

    def edge_body(i):
        value, k, inside = edge_x(i, e2, -float("inf"))
        # The smoothing terms read weight[k] and x[k] only where k is inside the row.
        terms = (te.exp(value - edge_max[i]),)
        if smoothing:
            safe = tirx.if_then_else(inside, k, tirx.IntImm(idx, 0))
            terms += smooth_terms(i, safe, inside)
        return sum_terms(terms, e2)

    edge_stats = te.compute(rows, edge_body, name="edge_sumexp")
    edge_stats = edge_stats if isinstance(edge_stats, (list, tuple)) else [edge_stats]

    # One online step joins the body's pair and the edges' pair.
    s_b, m_b, m_e, s_e = online[0], online[1], edge_max, edge_stats[0]
    row_max = te.compute(rows, lambda i: tirx.max(m_b[i], m_e[i]), name="row_max")
    row_sumexp = te.compute(
        rows, lambda i: s_b[i] * te.exp(m_b[i] - row_max[i]) + s_e[i] * te.exp(m_e[i] - row_max[i]),
        name="row_sumexp")

    def joined_sum(n):
        return te.compute(rows, lambda i: online[2 + n][i] + edge_stats[1 + n][i], name=f"row_extra{n}")

    extra = [joined_sum(n) for n in range(n_extra)]
    return row_max, row_sumexp, extra


def target_checks(problem, target: te.Tensor):
    """``valid_and_in_range(i) -> (t, valid, in_range)``: the row's target, whether it
    is not ignore_index (None when ignore_index cannot occur in the target dtype) and
    whether it lies in [0, V)."""
    ignore = problem.ignore_index
    target_limits = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
    lo, hi = target_limits[problem.target_dtype]
    ignore_possible = lo <= ignore <= hi

    def valid_and_in_range(i):
        t = target[i]
        valid = t != tirx.const(ignore, problem.target_dtype) if ignore_possible else None
        in_range = tirx.all(t >= tirx.const(0, t.dtype), t < tirx.const(problem.classes, t.dtype))
        return t, valid, in_range

    return valid_and_in_range


def guarded(ok, value):
    # if_then_else, not Select: Select may evaluate both sides, and the
    # simplifier drops a clamp inside it, so a bad target would be read.
    return tirx.if_then_else(ok, value, tirx.const(0.0, "float32"))


def row_ok(valid, in_range):
    """A row counts: its target is in range and (when it can occur) not ignore_index."""
    return in_range if valid is None else tirx.all(valid, in_range)


def row_loss_value(problem, x, weight, valid_and_in_range, extra, i, lse, idx: str):
    """Step 3: ``loss_i`` from the row's lse, 0 on a row that does not count."""
    eps = problem.label_smoothing
    t, valid, in_range = valid_and_in_range(i)
    ok = row_ok(valid, in_range)
    tc = t.astype(idx)
    w_t = weight[tc] if problem.has_weight else tirx.const(1.0, "float32")
    loss = w_t * (lse - x(i, tc))
    if eps > 0.0:
        total_weight = extra[1][i] if problem.has_weight else tirx.const(float(problem.classes), "float32")
        smooth = total_weight * lse - extra[0][i]
        loss = (1.0 - eps) * loss + (eps / problem.classes) * smooth
    return guarded(ok, loss)


def bad_row_value(problem, valid_and_in_range, i):
    """``i`` where row i's target is out of range and not ignored, else B (for a min)."""
    t, valid, in_range = valid_and_in_range(i)
    bad = tirx.Not(in_range) if valid is None else tirx.all(valid, tirx.Not(in_range))
    return tirx.Select(bad, i.astype("int32"), tirx.const(problem.batch, "int32"))


def row_weight_value(problem, weight, valid_and_in_range, i, idx: str):
    """``w[t_i]`` (1 without weight) on a row that counts, else 0: the mean's share."""
    t, valid, in_range = valid_and_in_range(i)
    w_t = weight[t.astype(idx)] if problem.has_weight else tirx.const(1.0, "float32")
    return guarded(row_ok(valid, in_range), w_t)


def cross_entropy_te(problem: CrossEntropyProblem, algorithm: str = "three_pass") -> list[te.Tensor]:
    """TE tensors, parameters first then outputs, for ``problem`` under ``algorithm``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"cross_entropy: algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
        )
    idx = index_dtype(problem.numel)
    batch, _ = dims(problem.shape, idx)
    rows = [batch]
    weighted = problem.has_weight

    logits, target, weight = placeholders(problem, idx)

    def x(i, k):
        return widen(logits[i, k], problem.dtype)

    row_max, row_sumexp, extra = row_statistics(problem, logits, weight, algorithm, idx)
    valid_and_in_range = target_checks(problem, target)

    # 3. Scalar transform per row.
    def row_loss_body(i):
        lse = logsumexp(row_max[i], row_sumexp[i])
        return row_loss_value(problem, x, weight, valid_and_in_range, extra, i, lse, idx)

    row_loss = te.compute(rows, row_loss_body, name="loss" if problem.reduction == "none" else "row_loss")

    # 4-5. Batch stage: sums over rows and the first bad target.
    i = te.reduce_axis((tirx.IntImm(idx, 0), batch), name="i")

    def bad_row(i):
        return bad_row_value(problem, valid_and_in_range, i)

    scalar = [tirx.IntImm(idx, 1)]
    if problem.reduction == "none":
        first_bad = te.compute(
            scalar, lambda _: te.min(bad_row(i), axis=i), name="first_bad_row"
        )
        params = [logits, target] + ([weight] if weighted else [])
        return params + [row_loss, first_bad]

    loss, first_bad, _ = batch_stage(problem, row_loss, weight, valid_and_in_range, i, idx)
    params = [logits, target] + ([weight] if weighted else [])
    return params + [row_loss, loss, first_bad]


def batch_stage(problem, row_loss: te.Tensor, weight, valid_and_in_range, i, idx: str) -> tuple:
    """Steps 4-5 over the rows (reduce axis ``i``) in one pass: the sum of the row
    losses, the mean's denominator and the first bad row (``BATCH_SUMS``), then
    ``loss`` and ``first_bad_row``. Returns ``(loss, first_bad_row, denominator)``."""
    scalar = [tirx.IntImm(idx, 1)]
    total, denom, first_bad_acc = te.compute(
        scalar,
        lambda _: BATCH_SUMS((row_loss[i], row_weight_value(problem, weight, valid_and_in_range, i, idx),
                              bad_row_value(problem, valid_and_in_range, i)), axis=i),
        name="batch",
    )

    def finish(z):
        return total[z] / denom[z] if problem.reduction == "mean" else total[z]

    loss = te.compute(scalar, finish, name="loss")
    first_bad = te.compute(scalar, lambda z: first_bad_acc[z], name="first_bad_row")
    return loss, first_bad, denom
