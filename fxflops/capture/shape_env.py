"""A ShapeEnv that blames the model's own source line for every guard and replacement, and whose
size-oblivious decisions follow the example and become guards.

torch's ShapeEnv attributes a guard to the first frame outside a fixed list of "uninteresting" torch
files; under the module-stack tracer that is ``nn/modules/module.py``. fxflops needs the user's line
("``seq`` was pinned by ``model.py:42``"), so this subclass skips every frame inside torch and fxflops.

Size-oblivious decisions. The trace runs with ``backed_size_oblivious`` (:func:`size_oblivious`) so
that a size-0/1 example does not pin its symbol. In that mode torch answers every ``guard_or_false(c)``
/ ``guard_or_true(c)`` it cannot prove from the symbols' ranges with the default (False / True) and
records nothing. At the sites torch's default is sound for counting (:data:`_SOUND_FUNCTIONS`,
:data:`_SOUND_SOURCES`, each read) that is kept: memory layout (strides, contiguity, storage size:
either answer gives tensors of the same sizes, a view or a copy, one stride order or another; a
model's own ``x.is_contiguous()`` is torch's exact symbolic condition, guarded as usual),
broadcasting, slicing and indexing (an undecided case is an exact symbolic size or a
``torch._check`` that becomes a guard), and choices between equal arithmetic (matmul's folding).
Elsewhere the default can change sizes: squeeze's ``guard_or_false(t == 1)`` keeps the dim of a ``t = 1`` example
(wrong for that very call), and a program traced at ``t = 3`` would be silently reused for ``t = 1``.
There :meth:`BlamingShapeEnv.decide` answers instead: the condition's truth at the example sizes,
recorded as a guard of the program (not a replacement: ``t == 1`` is a guard, never a pin). The
program then holds exactly where every such decision of its trace is the same; a call on the other
side (``t = 1`` after ``t = 3``) is captured again. A condition on unbacked (data-dependent) sizes
has no example value and keeps torch's default.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
import traceback
import types
from collections.abc import Iterator

import sympy
import torch
import torch.fx.experimental._config as fx_config
import torch.fx.experimental.symbolic_shapes as symbolic_shapes
from torch._guards import ShapeGuard
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxflops.capture.scope import patched

_FXFLOPS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fxflops/capture/.. (not the package: a cycle)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIPPED_DIRS = (_TORCH_DIR + os.sep, _FXFLOPS_DIR + os.sep)
_MODEL_DIR = os.path.join(_FXFLOPS_DIR, "models") + os.sep

# Where torch's size-oblivious default is sound for counting (torch 2.13, each site read), by file and
# function (any part of its qualified name): memory-layout reasoning (strides, contiguity, storage
# size, the memory format a kernel would pick), whose answers never change a size; broadcasting,
# slicing and indexing, whose undecided cases are exact symbolic expressions or torch._check's that
# become guards; and choices between equal arithmetic (matmul folding its batch into one mm, einsum's
# contraction order). A site missing here is decided from the example and guarded
# (BlamingShapeEnv.decide): more programs, never a wrong count. Sites whose default changes a size
# (squeeze's ``t == 1``, cat's 1-D empty inputs, a convolution with 0 input channels) are missing on
# purpose.
_SOUND_FUNCTIONS = {
    os.path.join(_TORCH_DIR, "_prims_common", "__init__.py"): frozenset({
        "check_contiguous_sizes_strides", "is_contiguous", "is_channels_last_contiguous_2d",
        "is_channels_last_contiguous_3d", "K", "_is_non_overlapping_and_dense_or_false",
        "compute_elementwise_output_logical_to_physical_perm", "are_strides_like_channels_last_or_false",
        "compute_required_storage_length", "_check_strides_helper", "infer_size", "same_shape",
    }),
    os.path.join(_TORCH_DIR, "_subclasses", "fake_impls.py"): frozenset({
        "_compute_stride", "_is_contiguous_with_hinted_checks", "_hinted_eq", "_view_unbacked_meta",
        "infer_size", "make_fast_binary_impl", "meta_select", "_compute_slice_index", "slice_forward",
    }),
    os.path.join(_TORCH_DIR, "_subclasses", "meta_utils.py"): frozenset({"meta_tensor"}),
    # a cached fake output rebuilt on its storage (``set_``'s bounds check)
    os.path.join(_TORCH_DIR, "_subclasses", "fake_tensor.py"): frozenset({"_get_output_tensor_from_cache_entry"}),
    os.path.join(_TORCH_DIR, "_prims", "__init__.py"): frozenset({"_collapse_view_helper", "_broadcast_in_dim_meta"}),
    os.path.join(_TORCH_DIR, "_refs", "__init__.py"): frozenset({
        "_broadcast_shapes", "_maybe_broadcast", "expand", "diagonal_scatter",
    }),
    os.path.join(_TORCH_DIR, "_meta_registrations.py"): frozenset({"meta_baddbmm"}),
    os.path.join(_TORCH_DIR, "_decomp", "decompositions.py"): frozenset({"should_fold", "matmul"}),
}
# the same for torch's C++ (a SymNode's guard_or_* is called with the C++ file and line): contiguity
# and storage; the backend (memory format) a convolution would pick; einsum's contraction plan;
# broadcasting (also repeat_interleave's one repeat count for all) and its reverse, summing a gradient
# to its input's shape (ExpandUtils' sum_to, autograd's shape check), each backed by a size check
_SOUND_SOURCES = (
    "c10/core/Contiguity.h", "c10/core/SymbolicShapeMeta.cpp", "c10/core/TensorImpl.h", "aten/src/ATen/core/TensorBase.h",
    "aten/src/ATen/EmptyTensor.cpp", "aten/src/ATen/TensorUtils.cpp", "aten/src/ATen/native/Convolution.cpp",
    "aten/src/ATen/native/Linear.cpp", "aten/src/ATen/ExpandUtils.h", "aten/src/ATen/ExpandUtils.cpp",
    "aten/src/ATen/native/Repeat.cpp", "torch/csrc/autograd/input_metadata.cpp",
)
_ASKING_SKIPPED = (os.path.abspath(symbolic_shapes.__file__), os.path.abspath(__file__), os.path.join(_FXFLOPS_DIR, "capture", "scope.py"))


def is_library_file(filename: str) -> bool:
    """True for files of torch or fxflops (never the place a model pins a size), except fxflops' own
    example models."""
    path = os.path.abspath(filename)
    return (path.startswith(_SKIPPED_DIRS) and not path.startswith(_MODEL_DIR)) or filename.startswith("<")


class BlamingShapeEnv(ShapeEnv):
    """ShapeEnv whose guard locations are the innermost frame of model code.

    No duck sizing (two inputs of equal example size stay distinct symbols) and no 0/1 specialisation.
    No event recording (torch keeps it to replay a ShapeEnv when debugging; ~10% of capture time).
    """

    def __init__(self) -> None:
        super().__init__(duck_shape=False, specialize_zero_one=False, should_record_events=False)
        self.decisions: dict[sympy.Basic, bool] = {}  # condition -> its truth at the example (a guard)
        self.sizes: set[sympy.Symbol] = set()  # symbols of sizes (never negative), for guards_of

    def decide(self, condition: sympy.Basic, default: bool) -> bool:
        """A condition torch would answer size-obliviously with ``default``: its truth at the example
        sizes, recorded as a guard (``condition`` or its negation) blamed on the model's line, with
        the axioms it implies so that later questions about it are answered statically. A condition
        on sizes without an example value (unbacked) keeps ``default``, as in torch."""
        if condition in self.decisions:
            return self.decisions[condition]
        value = condition.xreplace(self.backed_var_to_val)
        if not isinstance(value, sympy.logic.boolalg.BooleanAtom):
            return default
        truth = bool(value)
        guard = condition if truth else sympy.Not(condition)
        self.guards.append(ShapeGuard(guard, self._get_sloc(), size_oblivious=False))
        self.axioms.update(dict(self.get_implications(self.simplify(guard))))
        self.decisions[condition] = truth
        return truth

    def _get_user_frame(self) -> types.FrameType | None:
        frame = sys._getframe()
        while frame is not None and is_library_file(frame.f_code.co_filename):
            frame = frame.f_back
        return frame


def _decided(condition: torch.SymBool | bool, default: bool) -> bool:
    """``guard_or_false`` / ``guard_or_true`` (torch's ``_guard_or``) while tracing: a condition on a
    :class:`BlamingShapeEnv`'s sizes that its ranges do not settle, asked where torch's default is
    not known to be sound, is decided by :meth:`BlamingShapeEnv.decide`; everything else as torch does."""
    env = getattr(getattr(condition, "node", None), "shape_env", None)
    if not isinstance(env, BlamingShapeEnv) or _sound_default(sys._getframe(1)):
        return _torch_guard_or(condition, default)
    static = symbolic_shapes._static_eval_sym_bool(condition)
    return static if static is not None else env.decide(condition.node.expr, default)


def _sound_default(frame: types.FrameType | None) -> bool:
    """Whether the code asking is a site where torch's default is sound (:data:`_SOUND_FUNCTIONS`,
    :data:`_SOUND_SOURCES`): the C++ file a SymNode is asked from, or else the innermost Python
    function outside the ShapeEnv and fxflops' dispatch (for C++, the one that called into it)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("guard_or_false", "guard_or_true") and "file" in frame.f_locals:  # SymNode, from C++
            if str(frame.f_locals["file"]).endswith(_SOUND_SOURCES):
                return True
        elif (sound := _sound_function(code)) is not None:
            return sound
        frame = frame.f_back
    return False


@functools.cache
def _sound_function(code: types.CodeType) -> bool | None:
    """None for code of the ShapeEnv or fxflops' dispatch (not the asker), else whether it is in
    :data:`_SOUND_FUNCTIONS` (by any part of its qualified name)."""
    path = os.path.abspath(code.co_filename)
    if path in _ASKING_SKIPPED:
        return None
    return not _SOUND_FUNCTIONS.get(path, frozenset()).isdisjoint(code.co_qualname.split("."))


_torch_guard_or = symbolic_shapes._guard_or


@contextlib.contextmanager
def size_oblivious() -> Iterator[None]:
    """torch's ``backed_size_oblivious`` (size-0/1 examples do not pin their symbols) with every
    size-oblivious decision on a capture's sizes following the example as a guard (module docstring)."""
    with fx_config.patch(backed_size_oblivious=True), patched(symbolic_shapes, "_guard_or", _decided):
        yield


def format_location(loc: object) -> str:
    """``path:line in function`` plus the source line, from a FrameSummary or a string."""
    if isinstance(loc, traceback.FrameSummary):
        code = (loc.line or linecache.getline(loc.filename, loc.lineno or 0)).strip()
        where = f"{loc.filename}:{loc.lineno} in {loc.name}"
        return f"{where}: {code}" if code else where
    return str(loc) if loc else "an unknown location"
