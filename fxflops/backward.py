"""A call's backward, billed when a backward pass runs it: once per pass that runs it whole, never
when none runs, and said when a pass runs only part of it.

The traced program of a training call holds its backward; whether and how often that backward runs
is autograd's business, after the call. :func:`bill_backward` hangs a pre-hook on the output
nodes of the call's autograd graph; the :class:`BackwardBill` behind them adds the program's
backward (and recompute) phases to the meter at the end of each pass that reached every node the
traced backward starts from and every leaf it differentiates. The hooks hold no autograd node: a
node held by a hook of another node of the same graph makes a cycle through autograd's edges that
Python's collector cannot see, keeping the graph (its saved activations, the parameters' gradient
accumulators) alive after its tensors are gone. Used by ``instrument.py`` for a symbolic call and by
``islands.py`` for the symbolic children of a measured one.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from fxflops.meter import Meter
from fxflops.program import Program
from fxflops.situation import STRUCTURE


def bill_backward(bill: BackwardBill, nodes: list, roots: list) -> None:
    """Hook ``bill`` on the output ``nodes`` of a call and on its ``roots``, the nodes its traced
    backward starts from (each hook knows its node's index among the roots, not the node)."""
    index = {id(node): i for i, node in enumerate(roots)}
    hooked = {id(node): node for node in (*nodes, *roots)}.values()
    before = RemovableHandle.next_id
    for node in hooked:
        node.register_prehook(functools.partial(bill, index.get(id(node))))
    STRUCTURE.own_handles(before, len(hooked))  # not a change of any model's structure


def output_nodes(tensors: list[torch.Tensor]) -> list:
    """The autograd nodes of the output tensors that require grad; empty when one of them has none
    (a leaf returned as it is: its backward cannot be seen starting, and is billed with the forward)."""
    nodes: dict[int, Any] = {}
    for tensor in tensors:
        if tensor.requires_grad:
            node = tensor.grad_fn
            if node is None:
                return []
            nodes[id(node)] = node
    return list(nodes.values())


class BackwardBill:
    """A call's backward, added to the meter when a backward pass that reached the call's outputs
    ends: once per pass (autograd's graph task; a pass reaching several outputs bills once), again
    for each pass (``retain_graph``), never when none runs (an evaluation left in grad mode). A pass
    through only part of the call's graph runs less than the traced backward: one that does not reach
    every root (``roots``: how many output nodes the traced backward starts from: its loss, or every
    output, ``backward_roots``), or leaves whose gradients it does not compute
    (:func:`leaves_skipped`); one with ``create_graph=True`` makes a graph a later pass may
    differentiate (more work): neither counted (nor any pass after the latter), and said.

    It runs as the pre-hook of each output node (with the node's index among the roots, or None):
    the roots a pass reached are known at its end (a callback queued on the engine). It never raises
    into the backward.
    """

    __slots__ = ("meter", "program", "monomials", "prefix", "roots", "warn", "graphed", "passes", "failed")

    def __init__(self, meter: Meter, program: Program, monomials: tuple, prefix: str, roots: int, warn: Callable[[str], None]) -> None:
        self.meter, self.program, self.monomials, self.prefix = meter, program, monomials, prefix
        self.roots, self.warn, self.graphed = roots, warn, False
        self.passes: dict[int, tuple[str, set[int]]] = {}  # graph task -> (leaves it skips, roots it reached)
        self.failed: set[int | None] = set()  # passes whose hook failed (counted as uncounted once)

    def __call__(self, root: int | None, grad_outputs: Any) -> None:
        """Run as the pre-hook of an output node (being executed): the ``root``-th one, or None."""
        task = None
        try:
            task = _graph_task()
            with _FIRST:  # output nodes on two devices may run at once
                reached = self.passes.get(task)
                if reached is None:  # the first output node this pass runs: the highest in its graph
                    # a pass with create_graph=True records the gradients' own graph: a later pass through it
                    # (a gradient penalty, a double backward) runs work the traced backward does not have
                    self.graphed = self.graphed or torch.is_grad_enabled()
                    self.passes[task] = reached = (leaves_skipped(_running_node()), set())
                    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._settle, task))
                if root is not None:
                    reached[1].add(root)
        except Exception:  # noqa: BLE001 - a backward is never broken by telemetry
            self.passes.pop(task, None)  # its end bills nothing
            if task not in self.failed:  # one uncounted call per pass
                self.failed.add(task)
                self.meter.not_counted()

    def _settle(self, task: int) -> None:
        """At the end of pass ``task``: bill it, or say why not (nothing when it was not counted already)."""
        found = self.passes.pop(task, None)
        if found is None:
            return
        skipped, reached = found
        try:
            if self.graphed:
                why = GRAPH_RECORDED
            elif len(reached) < self.roots:
                why = "a backward that reaches only some of the call's outputs runs only part of the traced backward"
            elif skipped:
                why = f"{skipped} runs only part of the traced backward"
            else:
                self.meter.add(self.program, self.monomials, prefix=self.prefix, call=False, backward=True)
                return
            self.meter.not_counted()
            self.warn(f"{why}; call backward() on the call's loss (out.loss) when it returns one, else on a loss of every output")
        except Exception:  # noqa: BLE001, S110 - a backward is never broken by telemetry
            self.meter.not_counted()


GRAPH_RECORDED = (
    "a backward with create_graph=True records the gradients' own graph: a backward through it (a gradient penalty, "
    "a double backward) runs work the traced backward does not have"
)
_FIRST = threading.Lock()  # the first hook of a pass registers it (BackwardBill.__call__)
_graph_task, _running_node = torch._C._current_graph_task_id, torch._C._current_autograd_node


def leaves_skipped(running: Any) -> str:
    """What makes this backward pass, running output node ``running``, skip leaves the traced
    backward computes gradients for ("" when none): ``backward(inputs=...)``, or
    ``torch.autograd.grad`` (whose gradients are returned, not accumulated: torch does not tell
    which leaves it asks for, so it is refused also when asked for every parameter's), seen on the
    first leaf of the graph: a gradient accumulator that does not run."""
    leaf = first_leaf([running])
    if leaf is None:
        return ""
    try:
        executed = torch._C._will_engine_execute_node(leaf)
    except RuntimeError:  # asked of a leaf inside torch.autograd.grad
        executed = False
    return "" if executed else "a backward to only some of the leaves (backward(inputs=...), torch.autograd.grad())"


def first_leaf(nodes: list, limit: int = 256) -> Any:
    """The first gradient accumulator (a leaf that requires grad: a parameter, an input) reached
    from ``nodes``, looking at ``limit`` nodes at most; None when there is none."""
    stack, seen = list(nodes), set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "variable"):  # AccumulateGrad
            return node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return None


__all__ = ["GRAPH_RECORDED", "BackwardBill", "bill_backward", "leaves_skipped", "output_nodes"]
