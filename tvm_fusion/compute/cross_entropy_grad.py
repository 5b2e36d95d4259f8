"""Algorithm level of the cross entropy gradient: row statistics, per-row coefficients, a map.

``dlogits[i, v] = A_i e^(x_iv - c_i) - [v == t_i] B_i - C_i w_v`` (``contracts.
cross_entropy_grad`` derives it), every term float32 until the store into the logits
dtype, with per-row coefficients, one block each (``grad_shift``, ``grad_a``,
``grad_b``, ``grad_c`` with smoothing only, ``grad_t``)::

    c_i = row_max_i (fused) or lse_i (from_lse)          the exp's shift
    A_i = s_i a_i / row_sumexp_i (fused) or s_i a_i      a_i = (1 - eps) w[t_i] + eps W / V
    B_i = s_i (1 - eps) w[t_i]                           the target-class term
    C_i = s_i eps / V                                    the smoothing term
    t_i = the target as an index (-1 on a row that does not count)

``s_i`` is the upstream gradient over the mean's denominator: ``dloss / denom`` for
reduction="mean" (NaN where the denominator is 0, as torch), ``dloss`` for "sum",
``dloss[i]`` for "none"; ``dloss = 1`` in the fused mode. A row that does not count
(ignored, or a target out of range) gets ``B = C = 0`` and ``A = 0`` (fused: ``0 /
row_sumexp``): its gradient is ``0 * e^(x - c)``, zero but NaN on the whole row where
it holds NaN or +inf (or only -inf), as torch's; the row max alone would skip a NaN.
At the target class ``A p - B`` is float32 (``s w_t (p - 1)`` without smoothing):
in bf16, ``p - 1`` near p = 1 would keep no bit of ``1 - p``.

Decompositions (``algorithm``), by mode:

``fused``  ``t(R) -> denom, first_bad | x(SR) -> max(S) -> exp, sum(S) -> lse, row_loss,
coef(S) -> dlogits(SS) | row_loss(R) -> loss``
    0. ``target_stats`` over the targets first: the mean's ``denom = sum_i w[t_i]``
       (valid rows) and ``first_bad_row``; the scale of every row needs the
       denominator, so it is a first pass over B targets (B x 12 bytes, one small
       kernel on the GPU) rather than over the logits;
    1-2. ``row_max``, ``row_sumexp`` (+ smoothing sums) as the forward's ``three_pass``;
    3. ``lse``, ``row_loss`` (the forward's step 3) and the coefficients;
    4. ``dlogits``: the map over the row (a third read of the row, from cache);
    5. ``batch``: the sum of the row losses, ``loss`` = it (sum) or it over the
       denominator, summed again beside the losses (mean: the loss's epilogue then
       reads only what the batch pass computed; B more values).
``fused_online``  the same with the forward's ``online`` chunked statistics (1-2 in one
    read of the row; ``dlogits`` is the second).
``fused_head``  ``fused_online`` over ``row_head``, a copy of each row's first H values
    (:func:`head_length`: 192 KB), for k < H and the logits after: ``row_src`` (the
    statistics' chunks) and ``map_src`` (``dlogits``' vectors) each read ``row_head[i, k]``
    under ``likely(k < H)``, else ``logits[i, k]``, so that the build's loop partition
    splits their loops at H (:func:`head_sources`). Kept on chip, the head is read from
    HBM once; the tail twice.
``fused_poly_exp``  ``fused`` with the polynomial exp (LLVM vectorizes it).
``fused_padded``  ``fused`` with the forward's ``padded_three_pass`` statistics (the row's
    16-byte granules padded to a multiple of 32 lanes; V a multiple of a granule's
    elements); ``dlogits`` reads the logits themselves.
``fused_window``  ``t(R) -> denom, first_bad | x -> window(SSS) -> max(S) -> exp, sum(S) ->
lse, row_loss, coef(S) -> dlogits(SS) | row_loss(R) -> loss``, for rows off the
16-byte grid (V odd in fp16/bf16): the row's 16-byte granules of the *flat* logits,
each one aligned load, as one map a schedule keeps on chip, then ``fused`` over it.
With c values a granule, ``a_i = (iV) mod c`` (the row's start in its first granule)
and ``W = ceil((V + c - 1) / c)`` (the most granules a row touches):
    1. window[i, g, v] = x_flat[c min(floor(iV / c) + g, BV / c - 1) + v]   (B, W, c)
       (the clamp keeps the last row's window inside the tensor; BV a multiple of c)
    2. row_max, row_sumexp (+ smoothing sums) over the window's (g, v), element
       ``k = c g + v - a_i`` of the row where ``0 <= k < V`` (-inf / 0 elsewhere: the
       head's and tail's neighbours in the granules shared with the next rows)
    3-5. as ``fused``; ``dlogits[i, k]`` reads ``window[i, (k + a_i) / c, (k + a_i) mod c]``.
``fused_granules``  ``fused_window`` with the map laid out as the window: ``dlogits_granules[i,
g, v]`` (B, W, c) is the gradient of window position (g, v), row element ``k = c g + v -
a_i`` (the weight read at k clamped into the row), and ``dlogits[i,
k] = dlogits_granules[i, (k + a_i) / c, (k + a_i) mod c]`` gathers it. Unscheduled, that
is a copy. Built, :mod:`tvm_fusion.granule_stores` stores each granule of the map straight
into ``dlogits`` instead (granule g of the window is 16-byte granule ``floor(iV / c) + g``
of the flat gradient: one 16-byte store a granule inside the row, the row's own
elements of the edge granules one at a time) and drops the gather.
``fused_parts``  ``t(R) -> denom, first_bad | x(SRR) -> chunk (max, sumexp)(SS) -> part (max,
sumexp)(SS) -> (max, sumexp)(S) -> lse, row_loss, coef(S) -> dlogits_parts(SS) -> dlogits
| row_loss(R) -> loss``, for rows too long for one block's shared memory: each row cut
into P equal parts of whole 16-byte chunks (:func:`row_parts`), L = V / P values each,
and the parts laid out as the rows of a (B P, L) view, so that every stage of a part has
its own exact extent:
    1. ``fused_online``'s chunk statistics over each part, ``part_online[r]`` the (sum of
       exp, max, smoothing sums) of part ``r mod P`` of row ``floor(r / P)``;
    2. ``row_online[i]``: the P parts' pairs combined by the same online rule;
    3. as ``fused``; the map over the view, ``dlogits_parts[r, l]`` the gradient of row
       ``floor(r / P)``'s element ``(r mod P) L + l``, and ``dlogits`` gathered from it (a
       reshape: a schedule inlines the gather into the map's store, which then writes
       ``dlogits`` itself).
    A cluster schedule gives each part a block, the P blocks of a row one cluster, and
    exchanges the parts' pairs between 1 and 2 (``cross_entropy_grad_row_in_cluster``).
``fused_row_targets``  ``x(SR), t(SR) -> max(S), denom_i(S) -> exp, sum(S) -> lse, row_loss,
coef(S) -> dlogits(SS) | row_loss, t(R) -> loss, denom, first_bad``
    ``fused`` without the pass over the targets first, for small batches (the mean
    and sum): every row sums the mean's denominator over all B targets itself,
    ``row_denom[i] = sum_j w[t_j]`` (valid rows; the same value in every row), so
    that a row kernel needs nothing computed before it; the outputs ``denom`` and
    ``first_bad_row`` come from the batch stage, which sums the row losses, the
    denominator and the first bad row in one pass (the forward's ``batch_stage``).
    B times the targets' reads: a GPU schedule reads them from L2 in every row
    block, and saves the targets kernel's launch. "none" keeps ``fused``'s pass
    (it has no batch stage).
``from_lse``  ``t(R) -> denom | w(R) -> W | coef(S) -> dlogits(SS)``
    0. ``denom`` (mean) over the targets and ``weight_total`` (W, with weight and
       smoothing) over the weight, each a first small pass; 3. the coefficients;
       4. ``dlogits``: one read of the logits, one write.
``from_lse_poly_exp``  ``from_lse`` with the polynomial exp.

Why the fused denominator is a pass over the targets: ``dlogits`` is linear in
``1 / denom`` and is stored in the same pass that reads the row, and the denominator
depends on every row's target. The alternatives each cost more: every row block
summing the B targets itself (B^2 reads), storing ``dlogits`` unscaled and rescaling
it (two more passes over B x V), or a host value (a device sync, no graph capture).

PrimFunc parameters (inputs, then outputs):

``fused``     ``logits, target[, weight]``, then, in the order they are computed (TE
              lays the function's body out in the order of its outputs, and the row
              kernel must come after the target pass and before the batch sum):
              reduction="none": ``first_bad_row (1,) int32, lse (B,), loss (B,),
              dlogits (B, V)``; "sum": ``first_bad_row, lse, row_loss (B,), dlogits,
              loss (1,)``; "mean": ``first_bad_row, denom (1,), lse, row_loss,
              dlogits, loss``.
``from_lse``  ``logits, target[, weight], lse (B,) float32, dloss ((B,) for "none", else
              (1,); compiled kernels take it 0-d) float32``, then ``[denom (1,)]`` (mean), ``[weight_total (1,)]``
              (weight and smoothing), ``dlogits (B, V)``.

``first_bad_row`` and the guard on the gather are the forward's: a bad target is
flagged (fused) and its row's gradient is 0, never read out of bounds.
"""

from __future__ import annotations

from tvm import te, tirx

from ..contracts.common import DTYPE_BYTES
from ..contracts.cross_entropy_grad import CrossEntropyGradProblem
from .cross_entropy import (
    bad_row_value,
    batch_stage,
    guarded,
    online_chunk_statistics,
    placeholders,
    row_loss_value,
    row_ok,
    row_statistics,
    row_weight_value,
    sum_terms,
    target_checks,
)
from .primitives import (
    DUAL_SUM, ONLINE_LSE, dims, granule, index_dtype, logsumexp, poly_exp, tuple_reducer, widen,
)

GRANULES_ALGORITHM = "fused_granules"
ROW_TARGETS_ALGORITHM = "fused_row_targets"
PARTS_ALGORITHM = "fused_parts"
PARTS = "dlogits_parts"  # fused_parts' map, laid out as the (B P, L) view
GRANULES = "dlogits_granules"  # fused_granules' map, laid out as the window
# The decompositions that read the row from its window (``window_statistics``).
WINDOWED = ("fused_window", GRANULES_ALGORITHM)
ALGORITHMS = ("fused", "fused_online", "fused_poly_exp", "from_lse", "from_lse_poly_exp", "fused_padded",
              "fused_window", "fused_head", GRANULES_ALGORITHM, PARTS_ALGORITHM, ROW_TARGETS_ALGORITHM)
MODE_OF = {name: "from_lse" if name.startswith("from_lse") else "fused" for name in ALGORITHMS}
DEFAULT_FOR_MODE = {"fused": "fused", "from_lse": "from_lse"}
# The forward decomposition whose row statistics each fused decomposition reuses.
STATISTICS = {"fused": "three_pass", "fused_online": "online", "fused_head": "online",
              "fused_poly_exp": "three_pass_poly_exp", "fused_padded": "padded_three_pass",
              ROW_TARGETS_ALGORITHM: "three_pass"}

TARGET_SUMS = tuple_reducer(("sum", "min"), name="target_sums")
F32 = "float32"


def cross_entropy_grad_te(problem: CrossEntropyGradProblem, algorithm: str | None = None) -> list[te.Tensor]:
    """TE tensors, parameters first then outputs, for ``problem`` under ``algorithm``
    (by default the mode's: ``fused`` or ``from_lse``)."""
    algorithm = algorithm or DEFAULT_FOR_MODE[problem.mode]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"cross_entropy_grad: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if MODE_OF[algorithm] != problem.mode:
        raise ValueError(
            f"cross_entropy_grad: algorithm {algorithm!r} computes mode {MODE_OF[algorithm]!r}, "
            f"the problem asks for mode {problem.mode!r}"
        )
    fused = problem.mode == "fused"
    idx = index_dtype(problem.numel)
    batch, classes = dims(problem.shape, idx)
    rows, scalar = [batch], [tirx.IntImm(idx, 1)]
    eps = problem.label_smoothing
    smoothing = eps > 0.0
    weighted = problem.has_weight
    reduction = problem.reduction
    exp = poly_exp if algorithm.endswith("poly_exp") else te.exp

    logits, target, weight = placeholders(problem, idx)
    params = [logits, target] + ([weight] if weighted else [])
    if not fused:
        lse_in = te.placeholder(rows, F32, name="lse")
        dloss = te.placeholder([batch] if reduction == "none" else scalar, F32, name="dloss")
        params += [lse_in, dloss]

    def x(i, k):
        return widen(logits[i, k], problem.dtype)

    x_map = x  # what dlogits reads: the logits, or the window (fused_window)
    checks = target_checks(problem, target)
    i_all = te.reduce_axis((tirx.IntImm(idx, 0), batch), name="i")
    i_loss = te.reduce_axis((tirx.IntImm(idx, 0), batch), name="i2")

    # 0. Passes over the targets (and the weight) before any row.
    denom = first_bad = weight_total = row_denom = None
    # fused_row_targets: the batch stage computes these (below), every row its denominator.
    in_batch = algorithm == ROW_TARGETS_ALGORITHM and reduction != "none"
    if in_batch:
        if reduction == "mean":
            row_denom = te.compute(
                rows, lambda _: te.sum(row_weight_value(problem, weight, checks, i_all, idx), axis=i_all),
                name="row_denom",
            )
    elif fused and reduction == "mean":
        denom_acc, first_bad_acc = te.compute(
            scalar,
            lambda _: TARGET_SUMS((row_weight_value(problem, weight, checks, i_all, idx),
                                   bad_row_value(problem, checks, i_all)), axis=i_all),
            name="target_stats",
        )
        denom = te.compute(scalar, lambda z: denom_acc[z], name="denom")
        first_bad = te.compute(scalar, lambda z: first_bad_acc[z], name="first_bad_row")
    elif fused:
        first_bad = te.compute(
            scalar, lambda _: te.min(bad_row_value(problem, checks, i_all), axis=i_all), name="first_bad_row"
        )
    elif reduction == "mean":
        denom = te.compute(
            scalar, lambda _: te.sum(row_weight_value(problem, weight, checks, i_all, idx), axis=i_all),
            name="denom",
        )
    if not fused and weighted and smoothing:
        c_all = te.reduce_axis((tirx.IntImm(idx, 0), classes), name="c")
        weight_total = te.compute(scalar, lambda _: te.sum(weight[c_all], axis=c_all), name="weight_total")

    # 1-3. Row statistics and the forward's per-row outputs (fused).
    if fused:
        x_loss = x  # row_loss_value reads x(i, t_i) only
        if problem.in_place:
            # The row loss's one logit, read before anything of the row is written
            # (dlogits goes over the logits); 0 on a row that does not count.
            def target_logit_value(i):
                t, valid, in_range = checks(i)
                return guarded(row_ok(valid, in_range), x(i, t.astype(idx)))

            target_logit = te.compute(rows, target_logit_value, name="target_logit")
            x_loss = lambda i, _k: target_logit[i]  # noqa: E731
        if algorithm in WINDOWED:  # dlogits reads the row from the window
            x_map, row_max, row_sumexp, extra, window = window_statistics(
                problem, logits, weight, idx, granules=algorithm == GRANULES_ALGORITHM)
        elif algorithm == PARTS_ALGORITHM:  # the statistics and dlogits read the (B P, L) view
            parts_view = logits_parts(problem, logits, idx)
            (row_max, row_sumexp, extra), coef_stats = part_statistics(problem, parts_view, weight, idx)
        elif algorithm == "fused_head":  # the row's head from its copy, the tail from the logits
            row_src, map_src = head_sources(problem, logits, idx)
            row_max, row_sumexp, extra = row_statistics(problem, row_src, weight, STATISTICS[algorithm], idx)
            x_map = lambda i, k: widen(map_src[i, k], problem.dtype)  # noqa: E731
        else:
            row_max, row_sumexp, extra = row_statistics(problem, logits, weight, STATISTICS[algorithm], idx)
        if algorithm != PARTS_ALGORITHM:
            coef_stats = (row_max, row_sumexp, extra)
        lse_out = te.compute(rows, lambda i: logsumexp(row_max[i], row_sumexp[i]), name="lse")
        row_loss = te.compute(
            rows,
            lambda i: row_loss_value(problem, x_loss, weight, checks, extra, i,
                                     logsumexp(row_max[i], row_sumexp[i]), idx),
            name="loss" if reduction == "none" else "row_loss",
        )

    zero = tirx.IntImm(idx, 0)

    def scale(i):
        """s_i: the upstream gradient over the mean's denominator."""
        up = tirx.const(1.0, F32) if fused else dloss[i if reduction == "none" else zero]
        if reduction != "mean":
            return up
        d = denom[zero] if row_denom is None else row_denom[i]
        return tirx.Select(d == tirx.const(0.0, F32), tirx.const(float("nan"), F32), up / d)

    def coefficients(i):
        """(ok, t as an index, w[t], s_i, a_i) of row i."""
        t, valid, in_range = checks(i)
        ok = row_ok(valid, in_range)
        tc = t.astype(idx)
        w_t = guarded(ok, weight[tc]) if weighted else tirx.const(1.0, F32)
        a = (1.0 - eps) * w_t
        if smoothing:
            if weighted:
                total_w = coef_stats[2][1][i] if fused else weight_total[zero]
            else:
                total_w = tirx.const(float(problem.classes), F32)
            a = a + (eps / problem.classes) * total_w
        return ok, tc, w_t, scale(i), a

    def coef_a(i):
        ok, _, _, s, a = coefficients(i)
        # Divided after the guard: a row that does not count gets 0 / sum, NaN when
        # its sum is (a NaN or +inf logit, or only -inf), so its gradient is NaN
        # everywhere as torch's ``0 * p``; the max alone skips a NaN.
        return guarded(ok, s * a) / coef_stats[1][i] if fused else guarded(ok, s * a)

    def coef_b(i):
        ok, _, w_t, s, _ = coefficients(i)
        return guarded(ok, s * ((1.0 - eps) * w_t))

    def coef_c(i):
        ok, _, _, s, _ = coefficients(i)
        return guarded(ok, s * (eps / problem.classes))

    def coef_t(i):
        ok, tc, _, _, _ = coefficients(i)
        return tirx.Select(ok, tc, tirx.IntImm(idx, -1))

    # One block per coefficient (a schedule puts each in registers at the row).
    shift = te.compute(rows, lambda i: coef_stats[0][i] if fused else lse_in[i], name="grad_shift")
    grad_a = te.compute(rows, coef_a, name="grad_a")
    grad_b = te.compute(rows, coef_b, name="grad_b")
    grad_c = te.compute(rows, coef_c, name="grad_c") if smoothing else None
    grad_t = te.compute(rows, coef_t, name="grad_t")

    # 4. The map over the row.
    def grad_value(i, v, xv, weight_at=None):
        """The gradient of row i's class v, whose logit (widened) is ``xv``; the weight
        read at ``weight_at`` (v by default)."""
        g = grad_a[i] * exp(xv - shift[i])
        g = g - tirx.Select(v == grad_t[i], grad_b[i], tirx.const(0.0, F32))
        if smoothing:
            g = g - grad_c[i] * (weight[v if weight_at is None else weight_at] if weighted else tirx.const(1.0, F32))
        return g if problem.dtype == F32 else g.astype(problem.dtype)

    if algorithm == GRANULES_ALGORITHM:
        dlogits = granule_map(problem, window, grad_value, idx)
    elif algorithm == PARTS_ALGORITHM:
        dlogits = part_map(problem, parts_view, grad_value, idx)
    else:
        dlogits = te.compute((batch, classes), lambda i, v: grad_value(i, v, x_map(i, v)), name="dlogits")

    if not fused:
        return params + [t for t in (denom, weight_total) if t is not None] + [dlogits]

    # 5. Batch stage: the loss. Outputs in the order they are computed (the body's
    # order follows the output list): targets, rows, then the batch.
    if reduction == "none":
        return params + [first_bad, lse_out, row_loss, dlogits]
    if in_batch:  # the forward's batch stage, and the denominator as an output
        loss, first_bad, batch_denom = batch_stage(problem, row_loss, weight, checks, i_loss, idx)
        if reduction == "mean":
            denom = te.compute(scalar, lambda z: batch_denom[z], name="denom")
    elif reduction == "mean":
        # The denominator again beside the losses (B values): the epilogue may read
        # only what its own kernel computed (a GPU schedule's one-block reduction).
        total, batch_denom = te.compute(
            scalar,
            lambda _: DUAL_SUM((row_loss[i_loss], row_weight_value(problem, weight, checks, i_loss, idx)),
                               axis=i_loss),
            name="batch",
        )
        loss = te.compute(scalar, lambda z: total[z] / batch_denom[z], name="loss")
    else:
        total = te.compute(scalar, lambda _: te.sum(row_loss[i_loss], axis=i_loss), name="batch")
        loss = te.compute(scalar, lambda z: total[z], name="loss")
    head = [first_bad] + ([denom] if reduction == "mean" else [])
    return params + head + [lse_out, row_loss, dlogits, loss]


def window_granules(problem) -> int:
    """``fused_window``'s W: the most 16-byte granules one row touches, ``ceil((V + c -
    1) / c)``; a ValueError where the decomposition cannot hold the rows (``B V`` not a
    multiple of a granule's c values: the tensor's last granule would be partial, and
    its last row would read past the end; V under two granules)."""
    c = granule(problem.dtype)
    batch, classes = problem.shape
    if batch * classes % c or classes < 2 * c:
        raise ValueError(f"cross_entropy_grad: fused_window needs B * V a multiple of {c} and V >= {2 * c} for "
                         f"{problem.dtype}, got B = {batch}, V = {classes}")
    return -(-(classes + c - 1) // c)


def window_statistics(problem, logits: te.Tensor, weight: te.Tensor | None, idx: str, granules: bool = False) -> tuple:
    """``fused_window``'s steps 1-2: ``(x, row_max, row_sumexp, extra, window)``, ``x(i,
    k)`` the row's element k read from the window (what ``dlogits`` reads), the
    statistics as :func:`compute.cross_entropy.row_statistics` gives them, and the
    window itself. ``granules`` (``fused_granules``' form): the test that a position
    lies inside the row is granule-wise first and ``likely``, so that the build's loop
    partition (``compute.PARTITION_LIKELY``) can split the statistics' loops over the
    window into the steps whose granules all lie inside the row, unmasked, and the first
    and last steps, masked; and the sums read the max through a copy of their own
    (``sum_shift``), which a schedule keeps in each thread's registers (read straight
    from the allreduce's result, it is a volatile shared load an element)."""
    batch, classes = dims(problem.shape, idx)
    c = granule(problem.dtype)
    count = window_granules(problem)
    C, V = tirx.IntImm(idx, c), classes
    last = tirx.IntImm(idx, problem.batch * problem.classes // c - 1)
    smoothing = problem.label_smoothing > 0.0

    def flat(i, g, v):  # granule g of row i's window, clamped to the tensor's last
        return tirx.min(tirx.floordiv(i * V, C) + g, last) * C + v

    window = te.compute(
        [batch, tirx.IntImm(idx, count), C],
        lambda i, g, v: logits[tirx.floordiv(flat(i, g, v), V), tirx.floormod(flat(i, g, v), V)],
        name="window")

    body_last = tirx.IntImm(idx, problem.classes // c - 1)  # J: granules 1..J lie inside every row

    def element(i, g, v):  # (k, inside): the row's element at window position (g, v)
        k = g * C + v - row_start(i, V, C)
        inside = tirx.all(k >= tirx.IntImm(idx, 0), k < V)
        if granules:  # granule-wise first, one comparison a likely: what the partition splits at
            body = tirx.all(tirx.likely(g >= tirx.IntImm(idx, 1)), tirx.likely(g <= body_last))
            return k, tirx.Or(body, inside)
        return k, inside

    def masked(i, g, v, pad):
        _, inside = element(i, g, v)
        return tirx.Select(inside, widen(window[i, g, v], problem.dtype), tirx.const(pad, F32))

    def axes(suffix):
        return (te.reduce_axis((tirx.IntImm(idx, 0), tirx.IntImm(idx, count)), name=f"g{suffix}"),
                te.reduce_axis((tirx.IntImm(idx, 0), C), name=f"v{suffix}"))

    g, v = axes("")
    row_max = te.compute([batch], lambda i: te.max(masked(i, g, v, -float("inf")), axis=[g, v]), name="row_max")
    g2, v2 = axes("2")
    shift = te.compute([batch], lambda i: row_max[i], name="sum_shift") if granules else row_max

    def sums(i):
        # exp(-inf - max) = 0 outside the row: no select after the exp
        terms = (te.exp(masked(i, g2, v2, -float("inf")) - shift[i]),)
        if smoothing:
            k, inside = element(i, g2, v2)
            xv = masked(i, g2, v2, 0.0)
            if problem.has_weight:
                w = tirx.if_then_else(inside, weight[tirx.Select(inside, k, tirx.IntImm(idx, 0))], tirx.const(0.0, F32))
                terms += (w * xv, w)
            else:
                terms += (xv,)
        return sum_terms(terms, [g2, v2])

    stats = te.compute([batch], sums, name="row_sumexp")
    stats = stats if isinstance(stats, (list, tuple)) else [stats]

    def x(i, k):
        e = k + row_start(i, V, C)
        return widen(window[i, tirx.floordiv(e, C), tirx.floormod(e, C)], problem.dtype)

    return x, row_max, stats[0], list(stats[1:]), window


def row_start(i, classes, c):
    """``a_i``: row i's first element within its 16-byte granule of the flat tensor (``c``
    values a granule)."""
    return tirx.floormod(i * classes, c)


def granule_map(problem, window: te.Tensor, grad_value, idx: str) -> te.Tensor:
    """``fused_granules``' step 4: the map over the window's positions, ``GRANULES`` (B, W,
    c), then ``dlogits`` gathered from it (what a build replaces with stores of the
    granules themselves: :mod:`tvm_fusion.granule_stores`). A position outside the row
    (the edge granules' neighbours) computes a value never stored, with the weight of
    the row's nearest class (a read inside the weight)."""
    batch, classes = dims(problem.shape, idx)
    _, count, c = (int(d) for d in window.shape)
    C, V = tirx.IntImm(idx, c), classes
    zero, last = tirx.IntImm(idx, 0), tirx.IntImm(idx, problem.classes - 1)

    def position(i, g, v):
        k = g * C + v - row_start(i, V, C)
        return grad_value(i, k, widen(window[i, g, v], problem.dtype), tirx.min(tirx.max(k, zero), last))

    granules = te.compute([batch, tirx.IntImm(idx, count), C], position, name=GRANULES)

    def gathered(i, k):
        e = k + row_start(i, V, C)
        return granules[i, tirx.floordiv(e, C), tirx.floormod(e, C)]

    return te.compute([batch, classes], gathered, name="dlogits")


HEAD_BYTES = 192 * 1024  # the most of a row fused_head keeps on chip (one block an SM)
HEAD_GRAIN = 32768  # a head is a multiple of this many values: 1024 lanes x 8 values x a batch of 4


def head_length(problem) -> int:
    """``fused_head``'s H: the row's first H values, copied on chip; the most multiples of
    ``HEAD_GRAIN`` values within ``HEAD_BYTES`` that leave a tail. A row of a grain or
    less (no GPU candidate takes one; the decomposition's tests do) keeps all its whole
    16-byte chunks but the last value's; a ValueError for a row of one chunk or less."""
    chunk = granule(problem.dtype)
    if problem.classes <= chunk:
        raise ValueError(f"cross_entropy_grad: fused_head needs V > {chunk} for {problem.dtype}, "
                         f"got V = {problem.classes}")
    grains = min(HEAD_BYTES // (HEAD_GRAIN * DTYPE_BYTES[problem.dtype]), (problem.classes - 1) // HEAD_GRAIN)
    return grains * HEAD_GRAIN if grains >= 1 else (problem.classes - 1) // chunk * chunk


def head_sources(problem, logits: te.Tensor, idx: str) -> tuple[te.Tensor, te.Tensor]:
    """``fused_head``'s ``(row_src, map_src)``: the row as the statistics and ``dlogits``
    read it, ``row_head[i, k]`` (the copy of the row's first H values, a schedule keeps
    it in shared memory) for k < H, the logits after. The test is ``likely``, so that
    the build's loop partition (``compute.PARTITION_LIKELY``) splits a loop over the row at H into
    a loop over the copy and one over the logits, each without it; the copy's index is
    ``k mod H``: k where it is read, and inside the copy for the tail's k, so that no
    region a schedule sees reaches past it. Two tensors of one expression: each is
    staged into registers by its own reader, the statistics' chunks and the map's
    vectors."""
    head = head_length(problem)
    batch, classes = dims(problem.shape, idx)
    H = tirx.IntImm(idx, head)
    row_head = te.compute([batch, H], lambda i, k: logits[i, k], name="row_head")

    def source(i, k):
        return tirx.if_then_else(tirx.likely(k < H), row_head[i, tirx.floormod(k, H)], logits[i, k])

    return (te.compute([batch, classes], source, name="row_src"),
            te.compute([batch, classes], source, name="map_src"))


# fused_parts: a part of at most PART_BYTES keeps three blocks on an SM (sm_90: 227 KB of
# shared memory); rows of more than MAX_PARTS such parts take parts of up to
# PART_BYTES_MAX, one block an SM.
PART_BYTES = 75 * 1024
PART_BYTES_MAX = 200 * 1024
MAX_PARTS = 8  # a portable thread-block cluster's blocks
# Rows that fit one block (at most SHORT_ROW_BYTES: two blocks an SM of sm_90's 227 KB)
# are cut only where there are few of them, to spread a batch of fewer rows than SMs
# over the GPU: the fewest parts that give SPREAD_BLOCKS blocks, about four an SM of an
# H100's or H200's 132.
SHORT_ROW_BYTES = 112 * 1024  # schedules' cross_entropy_row_in_shared.ROW_BYTES_MAX (not imported here)
SPREAD_BLOCKS = 512


def row_parts(problem) -> int:
    """``fused_parts``' P: the fewest parts, 2 to ``MAX_PARTS``, that cut a row into equal
    whole 16-byte chunks of at most ``PART_BYTES``, else the most (the smallest parts, the
    most blocks an SM) of at most ``PART_BYTES_MAX``. A row of at most
    ``SHORT_ROW_BYTES`` takes the fewest that make ``SPREAD_BLOCKS`` blocks of the batch,
    else the most. A ValueError where none does (V not a multiple of two chunks' values,
    or a row past ``MAX_PARTS`` x ``PART_BYTES_MAX``)."""
    c = granule(problem.dtype)
    row = problem.classes * DTYPE_BYTES[problem.dtype]
    fitting = [p for p in range(2, MAX_PARTS + 1) if problem.classes % (p * c) == 0]
    if fitting and row <= SHORT_ROW_BYTES:
        return next((p for p in fitting if problem.batch * p >= SPREAD_BLOCKS), fitting[-1])
    small = [p for p in fitting if row // p <= PART_BYTES]
    if small:
        return small[0]
    large = [p for p in fitting if row // p <= PART_BYTES_MAX]
    if large:
        return large[-1]
    raise ValueError(f"cross_entropy_grad: fused_parts cuts a row into 2 to {MAX_PARTS} equal parts of whole "
                     f"{c}-value chunks of at most {PART_BYTES_MAX // 1024} KB; V = {problem.classes} "
                     f"({problem.dtype}) has none")


def logits_parts(problem, logits: te.Tensor, idx: str) -> te.Tensor:
    """``fused_parts``' (B P, L) view of the logits, ``logits_parts[r, l] = logits[floor(r
    / P), (r mod P) L + l]``: a stage a schedule keeps on chip, a part a block."""
    parts = row_parts(problem)
    P, L = tirx.IntImm(idx, parts), tirx.IntImm(idx, problem.classes // parts)
    return te.compute([tirx.IntImm(idx, problem.batch * parts), L],
                      lambda r, l: logits[tirx.floordiv(r, P), tirx.floormod(r, P) * L + l], name="logits_parts")


def part_statistics(problem, view: te.Tensor, weight: te.Tensor | None, idx: str) -> tuple:
    """``fused_parts``' steps 1-2 over the :func:`logits_parts` ``view``: twice ``(row_max,
    row_sumexp, extra)`` as :func:`compute.cross_entropy.row_statistics` gives them,
    from each part's online statistics over its chunks (``chunk_max``,
    ``chunk_sumexp``, ``part_online``) combined per row: for ``lse`` and the row loss
    (``row_online``), and for the gradient's coefficients (``row_online_map``). Two
    combines of one expression, because a schedule computes them in different places:
    the coefficients' in every block of the row, at the part; the outputs' in the row's
    first block, at the row."""
    parts, c = row_parts(problem), granule(problem.dtype)
    length = int(view.shape[1])
    P, L, C = (tirx.IntImm(idx, n) for n in (parts, length, c))
    smoothing = problem.label_smoothing > 0.0

    def x(r, j, v):
        return widen(view[r, j * C + v], problem.dtype)

    def extras(r, j, v):
        if smoothing and problem.has_weight:
            w = weight[tirx.floormod(r, P) * L + j * C + v]
            return (w * x(r, j, v), w)
        return (x(r, j, v),) if smoothing else ()

    part = online_chunk_statistics([view.shape[0], tirx.IntImm(idx, length // c)], c, idx, x, extras,
                                   name="part_online")
    reducer = ONLINE_LSE[len(part) - 2]
    zero = tirx.IntImm(idx, 0)

    def combined(name):
        p = te.reduce_axis((zero, P), name="p")
        stats = te.compute(dims([problem.batch], idx), lambda i: reducer(
            tuple(t[i * P + p] for t in part), axis=p), name=name)
        return stats[1], stats[0], list(stats[2:])

    return combined("row_online"), combined("row_online_map")


def part_map(problem, view: te.Tensor, grad_value, idx: str) -> te.Tensor:
    """``fused_parts``' step 3: the map over the :func:`logits_parts` ``view``, ``PARTS``,
    then ``dlogits`` gathered from it (a reshape, which a schedule inlines into the
    map's store)."""
    P, L = tirx.IntImm(idx, row_parts(problem)), view.shape[1]

    def position(r, l):
        i, k = tirx.floordiv(r, P), tirx.floormod(r, P) * L + l
        return grad_value(i, k, widen(view[r, l], problem.dtype))

    mapped = te.compute(view.shape, position, name=PARTS)
    return te.compute(dims(problem.shape, idx),
                      lambda i, k: mapped[i * P + tirx.floordiv(k, L), tirx.floormod(k, L)], name="dlogits")
