"""Runtime binding: a real call's arguments -> the values of the program's free symbols.

At capture every input dimension got an expression in the free symbols: the symbol itself, a constant
(a static dim, or one the model pinned), or another symbol (two dims the model tied together). The
binder reads each free symbol from the first dimension that *is* that symbol and checks every other
dimension against its expression, so a call whose shapes the trace does not describe is refused with
the input and dimension named. Only shapes are read: no tensor data, no device sync.

For speed the reading and checking is compiled to one small Python function per call layout (which
arguments come positionally, which by keyword); the general path through ``inspect`` runs once per
layout.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import sympy
from torch.utils._sympy.printers import PythonPrinter

from fxflops.capture.inputs import Path, bind_call, path_label
from fxflops.errors import InputError

_PRINTER = PythonPrinter()


def python_source(expr: sympy.Expr, names: dict[sympy.Symbol, str]) -> str:
    """Python source computing ``expr`` exactly in ints (``//`` for FloorDiv) over variables ``names``."""
    dummies = {sym: sympy.Symbol(name, integer=True, positive=True) for sym, name in names.items()}
    return _PRINTER.doprint(sympy.sympify(expr).xreplace(dummies))


class Binder:
    """Reads symbol values from calls of ``forward`` (see module docstring).

    ``dim_exprs`` maps each tensor input (by access path) to the traced expression of every one of its
    dimensions; ``symbols`` is the order of the returned values.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        dim_exprs: dict[Path, tuple[sympy.Expr, ...]],
        symbols: tuple[sympy.Symbol, ...],
    ) -> None:
        self._signature = inspect.signature(forward)
        self._forward = forward
        self.dim_exprs = dim_exprs
        self.symbols = symbols
        self._by_layout: dict[tuple, Callable[[tuple, dict], tuple[int, ...]]] = {}

    def values(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        """The free symbols' values for this call, in ``self.symbols`` order; InputError if off-trace."""
        layout = (len(args), tuple(kwargs))
        read = self._by_layout.get(layout)
        if read is None:
            read = self._by_layout[layout] = self._compile(args, kwargs)
        return read(args, kwargs)

    def _accessor(self, path: Path, positions: dict[str, str]) -> str:
        """Source text reaching the tensor at ``path`` from ``args``/``kwargs``."""
        head, rest = path[0], path[1:]
        code = positions[head]
        return code + "".join(f"[{step!r}]" for step in rest)

    def _compile(self, args: tuple, kwargs: dict) -> Callable[[tuple, dict], tuple[int, ...]]:
        """Generate the reader for calls laid out like this one."""
        named = bind_call(self._forward, args, kwargs)
        positions = self._positions(args, kwargs, named)
        missing = [path_label(p) for p in self.dim_exprs if p[0] not in positions]
        if missing:
            raise InputError(f"the call lacks tensor input(s) {missing} that the program was traced with")
        var = {sym: f"v{i}" for i, sym in enumerate(self.symbols)}
        reads: dict[sympy.Symbol, str] = {}
        lines, checks = [], []
        for j, (path, exprs) in enumerate(self.dim_exprs.items()):
            lines.append(f"    t{j} = {self._accessor(path, positions)}.shape")
            label = path_label(path)
            checks.append(
                f"    if len(t{j}) != {len(exprs)}: _fail({label!r}, None, {len(exprs)}, len(t{j}))"
            )
            for d, expr in enumerate(exprs):
                if expr in var and expr not in reads:
                    reads[expr] = f"t{j}[{d}]"
                    lines.append(f"    {var[expr]} = t{j}[{d}]")
                else:
                    want = python_source(expr, var)
                    checks.append(
                        f"    if t{j}[{d}] != {want}: _fail({label!r}, {d}, {str(expr)!r}, t{j}[{d}])"
                    )
        unread = [str(s) for s in self.symbols if s not in reads]
        if unread:
            raise InputError(f"no input dimension carries symbol(s) {unread}")
        # all reads first (shape lookups), then the checks that may use any symbol
        body = lines + checks
        body.append(f"    return ({', '.join(var[s] for s in self.symbols)}{',' if self.symbols else ''})")
        source = "def read(args, kwargs):\n" + "\n".join(body) + "\n"
        scope: dict[str, Any] = {"_fail": _fail}
        exec(compile(source, "<fxflops binder>", "exec"), scope)  # noqa: S102 - our own generated code
        return scope["read"]

    def _positions(self, args: tuple, kwargs: dict, named: dict[str, Any]) -> dict[str, str]:
        """Source text of each bound argument name: ``args[i]`` or ``kwargs['name']``."""
        params = list(self._signature.parameters.values())
        positions: dict[str, str] = {}
        i = 0
        for param in params:
            if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
                if i < len(args):
                    positions[param.name] = f"args[{i}]"
                    i += 1
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                for k in range(i, len(args)):
                    positions[f"{param.name}[{k - i}]"] = f"args[{k}]"
                i = len(args)
        for key in kwargs:
            positions[key] = f"kwargs[{key!r}]"
        return {name: code for name, code in positions.items() if name in named}


def _fail(label: str, dim: int | None, expected: Any, actual: Any) -> None:
    if dim is None:
        raise InputError(f"input {label!r} has rank {actual}; the program was traced with rank {expected}")
    raise InputError(
        f"input {label!r} dim {dim} is {actual}; the program was traced with this dim = {expected}"
    )

