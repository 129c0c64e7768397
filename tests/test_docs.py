"""The documentation runs: every ```python runnable block of README.md and docs/*.md.

A block is runnable when its opening fence is exactly ```` ```python runnable ````; plain ```` ```python ````
blocks are illustrations and are not run. The runnable blocks of one file run in order, with ``exec``,
in one shared namespace (a fresh module per file, so later blocks use earlier names), in a temporary
working directory. A failure names the file, the block index and the Markdown line, and the
traceback points at lines of the Markdown file itself.

Rules a document registers (``fxflops.rules.register``) are removed after its file ran, so a doc cannot
change what the other tests count.
"""

from __future__ import annotations

import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OPEN = "```python runnable"
CLOSE = "```"
# documents that may have no runnable block (README: the lead marks blocks runnable as wanted)
MAY_HAVE_NONE = {"README.md"}


@dataclass(frozen=True)
class Block:
    index: int  # 0-based position among the file's runnable blocks
    line: int  # 1-based line of the first code line in the Markdown file
    code: str


def runnable_blocks(text: str) -> list[Block]:
    """The ```python runnable blocks of a Markdown text, in order (fences at any indentation)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped == OPEN:
            indent = len(lines[i]) - len(lines[i].lstrip())
            start = i + 1
            j = start
            while j < len(lines) and lines[j].strip() != CLOSE:
                j += 1
            if j == len(lines):
                raise ValueError(f"unclosed ```python runnable block opened at line {i + 1}")
            code = "\n".join(_dedent(line, indent) for line in lines[start:j])
            blocks.append(Block(len(blocks), start + 1, code + "\n"))
            i = j + 1
        elif stripped.startswith("```"):  # skip any other fenced block whole (it may contain fences)
            fence = stripped[: len(stripped) - len(stripped.lstrip("`"))]
            j = i + 1
            while j < len(lines) and lines[j].strip() != fence:
                j += 1
            i = j + 1
        else:
            i += 1
    return blocks


def _dedent(line: str, indent: int) -> str:
    """``line`` without the fence's indentation (at most ``indent`` leading spaces)."""
    return line[min(indent, len(line) - len(line.lstrip(" "))) :]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def run_document(path: Path) -> types.ModuleType:
    """Run the file's runnable blocks in order in one fresh module namespace; raise AssertionError
    naming the block on the first failure."""
    from fxflops.rules import registry

    name = f"fxflops_docs_{path.stem.replace('-', '_')}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # dataclasses, pickling and inspect look the module up by name
    saved_rules = dict(registry._ENTRIES)
    try:
        for block in runnable_blocks(path.read_text(encoding="utf-8")):
            # pad so that tracebacks, warnings and guard locations give the Markdown line numbers
            code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
            try:
                exec(code, module.__dict__)  # noqa: S102 - the documentation's own examples
            except Exception as exc:
                raise AssertionError(
                    f"{_id(path)}: runnable block {block.index} (line {block.line}) failed: "
                    f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                ) from exc
    finally:
        registry._ENTRIES.clear()
        registry._ENTRIES.update(saved_rules)
        sys.modules.pop(name, None)
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()
    return module


@pytest.mark.parametrize("path", documents(), ids=_id)
def test_runnable_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = runnable_blocks(path.read_text(encoding="utf-8"))
    if not blocks:
        pytest.skip(f"{_id(path)} has no ```python runnable block")
    monkeypatch.chdir(tmp_path)
    run_document(path)


def test_docs_exist_and_have_runnable_blocks() -> None:
    expected = {"quickstart.md", "conventions.md", "ops-and-models.md", "custom-ops.md", "segments.md"}
    found = {p.name for p in DOCS.glob("*.md")}
    assert expected <= found, f"missing docs: {sorted(expected - found)}"
    without = [p.name for p in DOCS.glob("*.md") if p.name not in MAY_HAVE_NONE and not runnable_blocks(p.read_text(encoding="utf-8"))]
    assert not without, f"docs without a ```python runnable block: {without}"


def test_block_extraction() -> None:
    text = "\n".join(
        [
            "# t",
            "```python",
            "not_run()",
            "```",
            "````markdown",
            "```python runnable",
            "inside_a_quoted_fence()",
            "```",
            "````",
            "```python runnable",
            "a = 1",
            "",
            "b = a + 1",
            "```",
            "- item",
            "  ```python runnable",
            "  c = b * 2",
            "  ```",
        ]
    )
    blocks = runnable_blocks(text)
    assert [(b.index, b.line, b.code) for b in blocks] == [(0, 11, "a = 1\n\nb = a + 1\n"), (1, 17, "c = b * 2\n")]
    namespace: dict = {}
    for block in blocks:
        exec(block.code, namespace)  # noqa: S102
    assert namespace["c"] == 4
