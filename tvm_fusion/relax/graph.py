"""Reading and rewriting one Relax function: bindings, users, constants, replacements.

Both graph passes look at a function through :class:`Bindings` (who binds a
variable, who uses it, what a constant holds) and change it through
:func:`rewrite_bindings`, which gives chosen variables new values and leaves every
other binding as it was.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

# Variables inlined along one path at most: the forms the passes compare against
# are small (the label-smoothed cross entropy inlines 7), and stopping keeps the
# expansion small on graphs with many shared paths (residual blocks).
EXPAND_DEPTH = 12

Plan = Callable[[relax.BlockBuilder, Callable[[relax.Expr], relax.Expr]], relax.Expr]


class Bindings:
    """The variable bindings of one function, with each variable's users."""

    def __init__(self, name: str, func: relax.Function):
        self.name = name
        self.value: dict[relax.Var, relax.Expr] = dict(relax.analysis.get_var2val(func))
        self.users: dict[relax.Var, list[relax.Var | None]] = defaultdict(list)
        for var, value in self.value.items():
            for used in relax.analysis.free_vars(value):
                self.users[used].append(var)
        for used in relax.analysis.free_vars(func.body.body):
            self.users[used].append(None)  # the function's result

    def call(self, expr: relax.Expr, *op_names: str) -> tvm.ir.Call | None:
        """The call bound to ``expr`` when its operator is one of ``op_names``."""
        value = self.value.get(expr) if isinstance(expr, relax.Var) else expr
        if isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in op_names:
            return value
        return None

    def source(self, expr: relax.Expr) -> str:
        """What produces ``expr``, in words: "relax.nn.relu", "a function parameter", ..."""
        value = self.value.get(expr) if isinstance(expr, relax.Var) else expr
        if value is None:
            return "a function parameter"
        if isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op):
            return value.op.name
        return type(value).__name__

    def sole_user(self, var: relax.Var) -> relax.Var | None:
        users = self.users.get(var, [])
        return users[0] if len(users) == 1 else None

    def constant(self, expr: relax.Expr) -> np.ndarray | None:
        """The value of ``expr`` when it is a constant, or a reshape / transpose of one."""
        if isinstance(expr, tvm.ir.GenericConst) and isinstance(expr.value, tvm.runtime.Tensor):
            return expr.value.numpy()
        call = self.call(expr, "relax.reshape", "relax.permute_dims")
        if call is None:
            return None
        data = self.constant(call.args[0])
        if data is None:
            return None
        if call.op.name == "relax.reshape":
            return data.reshape([int(d) for d in call.args[1].values])
        axes = call.attrs.axes
        return np.transpose(data, None if axes is None else [int(a) for a in axes])

    def expand(self, expr: relax.Expr, leaves: list[relax.Expr], depth: int = EXPAND_DEPTH) -> relax.Expr:
        """``expr`` with bound variables replaced by their values, down to ``leaves``."""
        if depth == 0 or any(expr.same_as(leaf) for leaf in leaves):
            return expr
        if isinstance(expr, relax.Var) and expr in self.value:
            return self.expand(self.value[expr], leaves, depth - 1)
        if isinstance(expr, tvm.ir.Call):
            args = [self.expand(arg, leaves, depth) for arg in expr.args]
            return tvm.ir.Call(expr.op, args, expr.attrs, expr.ty_args)
        return expr

    def where(self, var: relax.Var) -> str:
        """``main: lv4 = relax.nn.batch_norm(lv2, ...)``: where a binding is, for reports."""
        value = self.value[var]
        if isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op):
            first = value.args[0] if value.args else None
            arg = first.name if isinstance(first, relax.Var) else "..."
            return f"{self.name}: {var.name} = {value.op.name}({arg}, ...)"
        return f"{self.name}: {var.name}"


def count_ops(mod: tvm.IRModule) -> Counter:
    """Operator calls in the module's Relax functions, by name; a ``call_tir`` of one of
    our kernels counts as ``tvm_fusion.<op>`` (its PrimFunc's ``tvm_fusion.op``)."""
    counts: Counter = Counter()
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        for value in relax.analysis.get_var2val(func).values():
            if not (isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op)):
                continue
            name = value.op.name
            if name == "relax.call_tir":
                attrs = mod[value.args[0]].attrs
                if attrs is not None and "tvm_fusion.op" in attrs:
                    name = f"tvm_fusion.{attrs['tvm_fusion.op']}"
            counts[name] += 1
    return counts


def shape_of(expr: relax.Expr) -> tuple[int, ...] | None:
    """The static shape of a tensor expression, or None when any size is symbolic."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def dtype_of(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def rewrite_bindings(mod: tvm.IRModule, plans: dict[str, dict[relax.Var, Plan]]) -> tvm.IRModule:
    """``mod`` with, in function ``name``, each variable of ``plans[name]`` bound anew.

    A plan gets the block builder (to emit helper bindings and add PrimFuncs) and a
    function that maps an old expression to the rewritten one; it returns the new
    value, which must have the old value's type. Bindings left unused are removed."""

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module: tvm.IRModule, plan: dict[relax.Var, Plan]):
            super().__init__(module)
            self.plan = plan

        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            make = self.plan.get(binding.var)
            if make is None:
                super().visit_var_binding_(binding)
                return
            value = self.builder_.normalize(make(self.builder_, self.visit_expr))
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))

    for name, plan in plans.items():
        if not plan:
            continue
        rewriter = Rewriter(mod, plan)
        gvar = mod.get_global_var(name)
        func = relax.analysis.remove_all_unused(rewriter.visit_expr(mod[gvar]))
        rewriter.builder_.update_func(gvar, func)
        mod = rewriter.builder_.get()
    return mod
