"""Runtime binding: a real call's arguments -> the values of the program's free symbols.

At capture every input dimension got an expression in the free symbols: the symbol itself, a constant
(a static dim, or one the model pinned), or another symbol (two dims the model tied together). The
binder reads each free symbol from the first dimension that *is* that symbol and checks every other
dimension against its expression, so a call whose shapes the trace does not describe is refused with
the input and dimension named. Only shapes are read: no tensor data, no device sync.

Segment power sums pₖ = Σᵢ sᵢᵏ come from the metadata input their family was built from (see
``analysis/segments.py``): for a tensor on the CPU from its values in Python (no device involved); for a
tensor on an accelerator (or the meta device) with tensor ops on that device, giving 0-d tensors that
the Meter accumulates there, so binding never waits for the device. Metadata on the host is always
validated (offsets start at 0 and never decrease, segments fit in the packed length); on a device
only with ``strict_metadata`` (reading the result is a sync).

For speed the reading and checking is compiled to one small Python function per call layout (which
arguments come positionally, which by keyword); the general path through ``inspect`` runs once per
layout.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
from torch.utils._sympy.printers import PythonPrinter

from fxflops.capture.derived import CountedSize
from fxflops.capture.inputs import Attr, Path, bind_call, path_label, signature_of
from fxflops.analysis.masks import KeptPairs
from fxflops.analysis.segments import ELEMENT, Family, column
from fxflops.errors import InputError, MetadataError

_PRINTER = PythonPrinter()
VALID = sympy.Symbol("metadata_valid", integer=True, nonnegative=True)  # 0 for a call whose device metadata is malformed


def python_source(expr: sympy.Expr, names: dict[sympy.Symbol, str]) -> str:
    """Python source computing ``expr`` exactly in ints (``//`` for FloorDiv) over variables ``names``,
    as torch prints its own guards (``math.trunc``, ``torch.sym_float``: see :func:`generated`)."""
    # integers, not positive ones: sympy would decide a guard like ``n >= 1`` True for a positive
    # symbol, and a size derived from values can be 0 (capture/derived.py)
    dummies = {sym: sympy.Symbol(name, integer=True) for sym, name in names.items()}
    return _PRINTER.doprint(sympy.sympify(expr).xreplace(dummies))


def generated(source: str, name: str, **names: Any) -> dict[str, Any]:
    """Run our own generated ``source`` (defining functions) in the scope torch evaluates its printed
    guards in (``ShapeEnv.evaluate_guards_expression``: ``math``, ``torch``, ...) plus ``names``;
    returns that scope. Each function it defines keeps ``source`` (snapshot tests, debugging)."""
    scope = {**SYMPY_INTERP, **names}
    exec(compile(source, f"<fxflops {name}>", "exec"), scope)  # noqa: S102 - our own generated code
    for value in list(scope.values()):  # each function keeps the source it was generated from
        if getattr(getattr(value, "__code__", None), "co_filename", None) == f"<fxflops {name}>":
            value.source = source
    return scope


_PROBES = (2, 3, 5, 7, 16, 100, 4097)


def guard_evaluator(guard: sympy.Basic, symbols: tuple[sympy.Symbol, ...]) -> Callable[..., bool] | None:
    """None when the guard's printed Python (:func:`generated`) evaluates as sympy does at a few
    probe points; otherwise an exact evaluator by substitution (slower, but never wrong)."""
    names = {sym: f"v{i}" for i, sym in enumerate(symbols)}
    params = ", ".join(names.values())
    try:
        printed = generated(f"def guard({params}):\n    return bool({python_source(guard, names)})\n", "guard")["guard"]
    except Exception:  # noqa: BLE001 - a form the printer cannot write as Python
        printed = None
    for value in _PROBES:
        point = {sym: value for sym in symbols}
        expected = _substituted(guard, point)
        try:
            agrees = printed is not None and (expected is None or printed(*point.values()) == expected)
        except Exception:  # noqa: BLE001 - e.g. a name the printed form needs and the scope lacks
            agrees = False
        if not agrees:
            return lambda *values: bool(_substituted(guard, dict(zip(symbols, values))))
    return None


def _substituted(guard: sympy.Basic, point: dict) -> bool | None:
    """The guard's truth at ``point`` by sympy substitution (None if sympy cannot decide it)."""
    try:
        value = guard.xreplace({sym: sympy.Integer(v) for sym, v in point.items()})
        return bool(value) if value in (sympy.true, sympy.false) or isinstance(value, bool) else None
    except (TypeError, ValueError, ZeroDivisionError):
        return None


class Binder:
    """Reads symbol values from calls of ``forward`` (see module docstring).

    ``dim_exprs`` maps each tensor input (by access path) to the traced expression of every one of its
    dimensions (an integer input, such as a size a compiled graph takes, maps to one expression);
    ``symbols`` is the order of the returned values.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        dim_exprs: dict[Path, tuple[sympy.Expr, ...]],
        symbols: tuple[sympy.Symbol, ...],
        stats: dict[sympy.Symbol, tuple[Family, int]] | None = None,
        strict_metadata: bool = False,
        flags: dict[str, sympy.Symbol] | None = None,
        kept_pairs: dict[sympy.Symbol, KeptPairs] | None = None,
        counts: dict[sympy.Symbol, CountedSize] | None = None,
    ) -> None:
        self._signature = signature_of(forward)
        self._forward = forward
        self.dim_exprs = dim_exprs
        self.symbols = symbols
        self.stats = stats or {}
        self.strict_metadata = strict_metadata
        # per segment family (by name): the symbol whose value is 1 when this call's metadata on a
        # device is malformed, and VALID: 0 when any is (see ``_stat_lines``)
        self.flags = flags or {}
        self.kept_pairs = kept_pairs or {}  # attention masks' kept triples, from their padding inputs
        self.counts = counts or {}  # derived sizes counted from an input's values (capture/derived.py)
        # CPU metadata is read on the host (no device involved). False computes it with tensor ops
        # as on an accelerator: the same code path, so it can be checked on a CPU-only machine.
        self.host_metadata = True
        self._by_layout: dict[tuple, Callable[[tuple, dict], tuple[int, ...]]] = {}
        self._weights: dict[tuple, torch.Tensor] = {}  # pair_weights and run indices, per shape and device (_cached)

    @property
    def reads_values(self) -> bool:
        """Whether some symbol comes from an input's values (segment power sums, a padding mask's
        kept pairs, a derived count): on a device, a 0-d tensor there."""
        return bool(self.stats or self.kept_pairs or self.counts)

    def values(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        """The free symbols' values for this call, in ``self.symbols`` order; InputError if off-trace."""
        read = self._by_layout.get((len(args), tuple(kwargs)))  # the hot path: one dict lookup
        return (read or self._reader(args, kwargs))(args, kwargs)

    def source(self, args: tuple, kwargs: dict) -> str:
        """The generated reader of calls laid out like this one, as Python source."""
        return self._reader(args, kwargs).source

    def _reader(self, args: tuple, kwargs: dict) -> Callable[[tuple, dict], tuple[int, ...]]:
        layout = (len(args), tuple(kwargs))
        read = self._by_layout.get(layout)
        if read is None:
            read = self._by_layout[layout] = self._compile(args, kwargs)
        return read

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_by_layout"] = {}  # generated readers are rebuilt on first use
        state["_weights"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("counts", {})  # a binder saved before derived counts existed
        self.__dict__.update(state)

    def _accessor(self, path: Path, positions: dict[str, str]) -> str:
        """Source text reaching the tensor at ``path`` from ``args``/``kwargs``."""
        head, rest = path[0], path[1:]
        code = positions[head]
        return code + "".join(f".{step.name}" if isinstance(step, Attr) else f"[{step!r}]" for step in rest)

    def _stat_lines(self, positions: dict[str, str], var: dict[sympy.Symbol, str]) -> list[str]:
        """Code computing every segment power sum, family by family (see the module docstring)."""
        lines: list[str] = []
        by_family: dict[str, list[tuple[sympy.Symbol, int]]] = {}
        families: dict[str, Family] = {}
        for sym, (family, k) in self.stats.items():
            by_family.setdefault(family.name, []).append((sym, k))
            families[family.name] = family
        for f, (name, wanted) in enumerate(sorted(by_family.items())):
            wanted = sorted(wanted, key=lambda item: item[1])  # by power: the same code in every process
            family = families[name]
            source = family.source
            if source[0] not in positions:
                raise InputError(f"the call lacks input {path_label(source)!r} that segment family {name!r} is built from")
            values, weights = family.lengths.values, family.lengths.weights
            host_names = {ELEMENT: "_x"} | {column(j): f"_x[{j}]" for j in range(64)}
            device_names = {ELEMENT: f"_m{f}"} | {column(j): f"_m{f}[:, {j}]" for j in range(64)}
            packed = [python_source(p, var) for p in sorted(family.packed, key=str)]
            covered = [python_source(p, var) for p in sorted(family.covered, key=str)]
            exact = "(" + "".join(f"{c}, " for c in covered) + ")"
            label = path_label(source)
            lines.append(f"    _m{f} = {self._accessor(source, positions)}")
            lines.append(f"    if _m{f}.is_cpu and _binder.host_metadata:")
            lines.append(f"        _r = _m{f}.tolist()")
            bounds = "(" + "".join(f"{p}, " for p in packed) + ")"
            limit = f"min({bounds})" if packed else "float('inf')"
            if values.diff:  # sorted() is one C call: offsets must be non-decreasing from 0
                uncovered = "".join(f" or _r[-1] != {c}" for c in covered)
                lines.append(f"        if not _r or _r[0] != 0 or _r[-1] > {limit}{uncovered} or _r != sorted(_r):")
                lines.append(f"            _check_offsets({label!r}, _r, {bounds}, {exact})")
                lines.append("        _v = [_b - _a for _a, _b in zip(_r, _r[1:])]")
            else:
                lines.append(f"        _v = [{python_source(values.expr, host_names)} for _x in _r]")
            if weights is None:
                if not values.diff:
                    uncovered = "".join(f" or sum(_v) != {c}" for c in covered)
                    lines.append(f"        if min(_v, default=0) < 0 or sum(_v) > {limit}{uncovered}:")
                    lines.append(f"            _check_lengths({label!r}, [(_a, 1) for _a in _v], {bounds}, {exact})")
            else:
                lines.append(f"        _w = [{python_source(weights.expr, host_names)} for _x in _r]")
                uncovered = "".join(f" or sum(map(_mul, _v, _w)) != {c}" for c in covered)
                lines.append(f"        if min(_v, default=0) < 0 or min(_w, default=0) < 0 or sum(map(_mul, _v, _w)) > {limit}{uncovered}:")
                lines.append(f"            _check_lengths({label!r}, list(zip(_v, _w)), {bounds}, {exact})")
            if family.conditions:  # bounds a lifted module's one-segment trace relied on
                ok = " and ".join(f"({python_source(c, {ELEMENT: '_a'})})" for c in sorted(family.conditions, key=str))
                weights_of = "_w" if weights is not None else "[1] * len(_v)"
                lines.append(f"        _bad = [_a for _a, _c in zip(_v, {weights_of}) if _c and not ({ok})]")
                conditions = ", ".join(str(c.xreplace({ELEMENT: sympy.Symbol("s")})) for c in sorted(family.conditions, key=str))
                lines.append(f"        if _bad: _fail_segments({label!r}, _bad, {conditions!r})")
            for sym, k in wanted:
                power = "*".join(["_a"] * k) if k else "1"
                if weights is None:
                    lines.append(f"        {var[sym]} = sum([{power} for _a in _v])")
                else:
                    lines.append(f"        {var[sym]} = sum([_c * {power} for _a, _c in zip(_v, _w)])")
            if name in self.flags:  # host metadata was checked: malformed raised MetadataError above
                lines.append(f"        {var[self.flags[name]]} = 0")
            lines.append("    else:")
            if values.diff:
                lines.append(f"        _m{f} = _m{f}.long()")
                lines.append(f"        _v = _m{f}[1:] - _m{f}[:-1]")
                lines.append("        _w = 1")
            else:
                lines.append(f"        _m{f} = _m{f}.long()")
                lines.append(f"        _v = {python_source(values.expr, device_names)}")
                lines.append(f"        _w = {'1' if weights is None else python_source(weights.expr, device_names)}")
            if self.strict_metadata:
                lines.append(f"        _check_device({label!r}, _m{f}, _v, _w, {values.diff}, {bounds}, {exact})")
            for sym, k in wanted:
                lines.append(f"        {var[sym]} = (_w * _v ** {k}).sum()")
            if name in self.flags:  # the host checks above as tensor ops: a flag, read with the sums
                lines.append(f"        {var[self.flags[name]]} = {self._malformed(f, family, packed, covered)}")
        if self.flags:
            valid = " * ".join(f"(1 - {var[s]})" for s in self.flags.values())
            lines.append(f"    {var[VALID]} = {valid}")
        return lines

    def _count_lines(self, positions: dict[str, str], var: dict[sympy.Symbol, str]) -> list[str]:
        """Code computing each derived count (``CountedSize.count``: an int for a CPU input, a 0-d
        tensor on the input's device otherwise)."""
        lines = []
        for i, sym in enumerate(sorted(self.counts, key=str)):
            source = self.counts[sym].source
            if source[0] not in positions:
                raise InputError(f"the call lacks input {path_label(source)!r} that size {sym} is counted from")
            lines.append(f"    {var[sym]} = _counts[{i}].count({self._accessor(source, positions)}, _binder.host_metadata)")
        return lines

    def _pair_lines(self, positions: dict[str, str], var: dict[sympy.Symbol, str]) -> list[str]:
        """Code computing each kept-pairs statistic (``analysis/masks.py``): Σ over rows b and keys
        k < K of [padding[b, k] ≠ 0] · (the queries that see key k, ``pair_weights``), with tensor
        ops on the padding input's device: the non-zero count per key times its weight (a 0-d tensor
        there; read as an int on the CPU: no sync). Without padding (a sliding window): the rows
        times the weights' sum, from the sizes on the host."""
        lines, runs = [], {}
        for j, (sym, pairs) in enumerate(sorted(self.kept_pairs.items(), key=lambda item: str(item[0]))):
            queries, keys, offset, window = (
                python_source(e, var) if e is not None else "None" for e in (pairs.queries, pairs.keys, pairs.offset, pairs.window)
            )
            if pairs.runs is not None:
                lines += self._run_lines(j, sym, pairs, positions, var, runs)
                continue
            if pairs.padding is None:
                batch = python_source(pairs.batch, var)
                lines.append(f"    {var[sym]} = ({batch}) * int(_binder.pair_weights({keys}, {queries}, {offset}, 'cpu', {window}).sum())")
                continue
            if pairs.padding[0] not in positions:
                raise InputError(f"the call lacks input {path_label(pairs.padding)!r} that the attention mask is built from")
            lines.append(f"    _q{j} = {self._accessor(pairs.padding, positions)}")
            lines.append(f"    _k{j} = {keys}")
            lines.append(f"    if _q{j}.shape[1] != _k{j}: _q{j} = _q{j}[:, :_k{j}]")
            lines.append(f"    _w{j} = _binder.pair_weights(_k{j}, {queries}, {offset}, _q{j}.device, {window})")
            lines.append(f"    if _q{j}.is_cpu and _binder.host_metadata: {var[sym]} = int(torch.count_nonzero(_q{j}, 0).dot(_w{j}))")
            lines.append(f"    else: {var[sym]} = ((_q{j} != 0).sum(0) * _w{j}).sum()")
        return lines

    def _run_lines(
        self, j: int, sym: sympy.Symbol, pairs: KeptPairs, positions: dict[str, str], var: dict[sympy.Symbol, str], runs: dict
    ) -> list[str]:
        """Code for a packed mask's statistic (``KeptPairs.runs``) from the positions input P (R rows
        of S, broadcast to the batch), with tensor ops on its device. With n the place of each token
        in its run (1 for its first) and f = j − n + 1 the index of its run's first token, Σ n =
        R·S(S+1)/2 − Σ f (causal) and Σ (2n − 1) = R·S² − 2·Σ f (whole blocks), from one Σ f per
        input (``run_starts_sum``, shared in ``runs``); a window needs Σ min(n, W) (``run_places``)."""
        if pairs.runs[0] not in positions:
            raise InputError(f"the call lacks input {path_label(pairs.runs)!r} that the attention mask is built from")
        lines = []
        if pairs.runs not in runs:
            p = runs[pairs.runs] = f"_p{j}"
            lines += [
                f"    {p} = {self._accessor(pairs.runs, positions)}",
                f"    {p}_rows, {p}_len = {p}.shape[0], {p}.shape[-1]",
                f"    {p}_first = _binder.run_starts_sum({p})",
                f"    if {p}.is_cpu and _binder.host_metadata: {p}_first = int({p}_first)",
            ]
        p = runs[pairs.runs]
        broadcast = f"(({python_source(pairs.batch, var)}) // {p}_rows)"
        if pairs.offset is None:
            total = f"{p}_rows * {p}_len * {p}_len - 2 * {p}_first"
        elif pairs.window is None:
            total = f"{p}_rows * {p}_len * ({p}_len + 1) // 2 - {p}_first"
        else:
            total = f"_binder.run_places({p}).clamp(max={python_source(pairs.window, var)}).sum()"
        lines.append(f"    {var[sym]} = {broadcast} * ({total})")
        if pairs.window is not None:
            lines.append(f"    if {p}.is_cpu and _binder.host_metadata: {var[sym]} = int({var[sym]})")
        return lines

    def run_starts_sum(self, positions: torch.Tensor) -> torch.Tensor:
        """Σ over the tokens of ``positions`` (rows of S) of the index of the first token of their run of
        consecutive positions (``_run_firsts``; 0 for token 0): a 0-d tensor, no host read."""
        return self._run_firsts(positions)[1].sum()

    def run_places(self, positions: torch.Tensor) -> torch.Tensor:
        """Each token's place n (1, 2, ...) in its run (``_run_firsts``): 1 for token 0, and
        j − (its run's first index) + 1 after."""
        index, firsts = self._run_firsts(positions)
        places = index - firsts + 1
        return torch.cat([torch.ones_like(places[..., :1]), places], -1)

    def _run_firsts(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For tokens j ≥ 1 of each row: j, and the index of the first token of j's run. A run starts
        at index 0 and wherever a position is not its predecessor's + 1 (HF's
        ``find_packed_sequence_indices``), so that index is the running maximum of j·[P[j] − P[j−1] ≠ 1]."""
        steps = positions[..., 1:] - positions[..., :-1] != 1
        length, device = positions.shape[-1], positions.device
        index = self._cached(("indices", length, device), lambda: torch.arange(1, length, device=device))
        return index, (index * steps).cummax(-1).values

    def pair_weights(self, keys: int, queries: int, offset: int, device: torch.device, window: int | None = None) -> torch.Tensor:
        """For each key k < K the queries q < Q that see it: k ≤ q + offset, and with a sliding
        ``window`` also k > q + offset − window, i.e. q from max(0, k − offset) to
        min(Q − 1, k − offset + window − 1)."""

        def weights() -> torch.Tensor:
            first = (torch.arange(keys, device=device) - offset).clamp(min=0)
            last = torch.full_like(first, queries - 1)
            if window is not None:
                last = last.minimum(torch.arange(keys, device=device) - offset + window - 1)
            return (last - first + 1).clamp(min=0)

        return self._cached((keys, queries, offset, window, device), weights)

    def _cached(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor per shape and device, made once (one per sequence length, not per call); many
        lengths: the cache is emptied past 256 entries."""
        tensor = self._weights.get(key)
        if tensor is None:
            if len(self._weights) >= 256:
                self._weights.clear()
            tensor = self._weights[key] = make()
        return tensor

    @staticmethod
    def _malformed(f: int, family: Family, packed: list[str], covered: list[str]) -> str:
        """Source of a 0-d int64 tensor on the metadata's device: 1 when the host checks would fail
        (offsets not from 0, a negative length, past the packed length, not covering a lifted
        module's rows, a segment outside a lifted module's conditions), computed without a sync."""
        tests = ["(_v < 0).any()", "(_w < 0).any()" if family.lengths.weights is not None else None]
        if family.lengths.values.diff:
            tests.append(f"(_m{f}[:1] != 0).any()")
        tests += [f"((_w * _v).sum() > {p})" for p in packed] + [f"((_w * _v).sum() != {c})" for c in covered]
        if family.conditions:
            ok = " & ".join(f"({python_source(c, {ELEMENT: '_v'})})" for c in sorted(family.conditions, key=str))
            tests.append(f"(~({ok}) & (_w != 0)).any()" if family.lengths.weights is not None else f"(~({ok})).any()")
        return "(" + " | ".join(f"({t})" for t in tests if t) + ").long()"

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
            label = path_label(path)
            if isinstance(exprs, sympy.Expr):  # an integer argument (a size a compiled graph takes)
                lines.append(f"    t{j} = {self._accessor(path, positions)}")
                if exprs in var and exprs not in reads:
                    reads[exprs] = f"t{j}"
                    lines.append(f"    {var[exprs]} = t{j}")
                else:
                    want = python_source(exprs, var)
                    checks.append(f"    if t{j} != {want}: _fail({label!r}, 'value', {str(exprs)!r}, t{j})")
                continue
            lines.append(f"    t{j} = {self._accessor(path, positions)}.shape")
            lines.append(f"    if len(t{j}) != {len(exprs)}: _fail({label!r}, None, {len(exprs)}, len(t{j}))")
            expected = {}
            for d, expr in enumerate(exprs):
                if expr in var and expr not in reads:
                    reads[expr] = f"t{j}[{d}]"
                    lines.append(f"    {var[expr]} = t{j}[{d}]")
                else:
                    expected[d] = expr
            if expected:  # one test per tensor; the slow path says which dim is off
                test = " or ".join(f"t{j}[{d}] != {python_source(e, var)}" for d, e in expected.items())
                wants = ", ".join(f"({d}, {python_source(e, var)}, {str(e)!r})" for d, e in expected.items())
                checks.append(f"    if {test}: _fail_dims({label!r}, t{j}, ({wants},))")
        computed = set(self.stats) | set(self.kept_pairs) | set(self.counts) | set(self.flags.values()) | ({VALID} if self.flags else set())
        unread = [str(s) for s in self.symbols if s not in reads and s not in computed]
        if unread:
            raise InputError(f"no input dimension carries symbol(s) {unread}")
        # all reads first (shape lookups), then the checks that may use any symbol, then segments
        body = lines + checks + self._stat_lines(positions, var) + self._pair_lines(positions, var) + self._count_lines(positions, var)
        body.append(f"    return ({', '.join(var[s] for s in self.symbols)}{',' if self.symbols else ''})")
        source = "def read(args, kwargs):\n" + "\n".join(body) + "\n"
        scope = generated(
            source,
            "binder",
            _fail=_fail,
            _fail_dims=_fail_dims,
            _check_offsets=_check_offsets,
            _check_lengths=_check_lengths,
            _check_device=_check_device,
            _fail_segments=_fail_segments,
            _binder=self,
            _counts=[self.counts[sym] for sym in sorted(self.counts, key=str)],
            _mul=operator.mul,
            torch=torch,
        )
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


def _check_offsets(label: str, offsets: list[int], packed: tuple[int, ...], exact: tuple[int, ...] = ()) -> None:
    """Host check of a cumulative-offsets input: starts at 0, never decreases, fits every packed dim
    (and covers exactly those a per-segment module processes)."""
    if not offsets or offsets[0] != 0:
        raise MetadataError(f"segment offsets {label!r} must start at 0, got {offsets[:4]}...")
    drops = [i for i in range(1, len(offsets)) if offsets[i] < offsets[i - 1]]
    if drops:
        i = drops[0]
        raise MetadataError(
            f"segment offsets {label!r} decrease at index {i} ({offsets[i - 1]} -> {offsets[i]}); "
            "cumulative offsets must be non-decreasing"
        )
    for total in packed:
        if offsets[-1] > total:
            raise MetadataError(f"segment offsets {label!r} end at {offsets[-1]}, past the packed length {total}")
    for total in exact:
        if offsets[-1] != total:
            raise MetadataError(
                f"segment offsets {label!r} end at {offsets[-1]}, but a per-segment module processes all "
                f"{total} packed rows: the offsets must cover them exactly"
            )


def _check_lengths(label: str, pairs: list[tuple[int, int]], packed: tuple[int, ...], exact: tuple[int, ...] = ()) -> None:
    """Host check of lengths built from metadata rows (e.g. grid_thw): nonnegative, fit the packed dim."""
    bad = [i for i, (v, w) in enumerate(pairs) if v < 0 or w < 0]
    if bad:
        raise MetadataError(f"metadata {label!r} row {bad[0]} gives a negative segment length or count: {pairs[bad[0]]}")
    covered = sum(v * w for v, w in pairs)
    for total in packed:
        if covered > total:
            raise MetadataError(
                f"metadata {label!r} describes segments totalling {covered}, more than the packed length {total} "
                "of the tensor it cuts"
            )
    for total in exact:
        if covered != total:
            raise MetadataError(
                f"metadata {label!r} describes segments totalling {covered}, but a per-segment module "
                f"processes all {total} packed rows: they must match exactly"
            )


def _check_device(
    label: str, source: Any, values: Any, weights: Any, is_offsets: bool, packed: tuple[int, ...], exact: tuple[int, ...]
) -> None:
    """The same checks with tensor ops on the metadata's device (each ``bool()`` is a host sync)."""
    if is_offsets and bool(source[0] != 0):
        raise MetadataError(f"segment offsets {label!r} must start at 0")
    if bool((values < 0).any()) or bool((torch.as_tensor(weights) < 0).any()):
        raise MetadataError(f"metadata {label!r} gives a negative segment length (offsets decreasing?)")
    covered = (values * weights).sum()
    for total in packed:
        if bool(covered > total):
            raise MetadataError(f"metadata {label!r} describes segments past the packed length {total}")
    for total in exact:
        if bool(covered != total):
            raise MetadataError(f"metadata {label!r} must cover all {total} rows a per-segment module processes")


def _fail_segments(label: str, bad: list[int], conditions: str) -> None:
    raise MetadataError(
        f"segments of length {sorted(set(bad))[:5]} from {label!r}: a per-segment module was traced "
        f"assuming {conditions} for every segment"
    )


def _fail_dims(label: str, shape: Any, wanted: tuple[tuple[int, int, str], ...]) -> None:
    """Raise for the first dim of ``shape`` that differs from its traced value."""
    for dim, value, expr in wanted:
        if shape[dim] != value:
            _fail(label, dim, expr, shape[dim])


def _fail(label: str, dim: int | str | None, expected: Any, actual: Any) -> None:
    if dim == "value":
        raise InputError(f"input {label!r} is {actual}; the program was traced with {expected}")
    if dim is None:
        raise InputError(f"input {label!r} has rank {actual}; the program was traced with rank {expected}")
    raise InputError(
        f"input {label!r} dim {dim} is {actual}; the program was traced with this dim = {expected}"
    )

