"""Models of the exactness tests: each a factory, its dims, and a strategy for random input shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from fxflops.models.tiny_gpt import GPTConfig, TinyGPT


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 80)
        self.fc2 = nn.Linear(80, 24)
        self.out = nn.Linear(24, 7, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc2(F.gelu(self.fc1(x))) + x)


class CNN(nn.Module):
    """Plain, strided, grouped, depthwise, dilated, transposed, 1-d and 3-d convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.grouped = nn.Conv2d(32, 32, 3, padding=2, dilation=2, groups=4)
        self.depthwise = nn.Conv2d(32, 32, 5, padding=2, groups=32)
        self.up = nn.ConvTranspose2d(32, 8, 4, stride=2, padding=1, output_padding=0)
        self.line = nn.Conv1d(8, 12, 3, stride=2)
        self.vol = nn.Conv3d(1, 4, (2, 3, 3), padding=(0, 1, 1))
        self.head = nn.Linear(12 + 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        x = F.relu(self.down(x))
        x = self.depthwise(self.grouped(x)) + x
        x = self.up(x)  # (b, 8, ~H, ~W)
        rows = self.line(x.mean(dim=3))  # (b, 12, L)
        vol = self.vol(x[:, :2].unsqueeze(1))  # (b, 4, 1, H, W)
        pooled = torch.cat([rows.mean(dim=2), vol.mean(dim=(2, 3, 4))], dim=1)
        return self.head(pooled)


class EinsumAttention(nn.Module):
    """Multi-head attention written with einsum (bmm under the hood), bidirectional."""

    def __init__(self, dim: int = 48, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        scores = torch.einsum("bshd,bthd->bhst", q, k) / (d // self.heads) ** 0.5
        y = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)
        return self.proj(y.reshape(b, s, d))


class Shared(nn.Module):
    """A reused submodule (called twice per forward), nesting, and a matmul whose result is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self.inner = nn.ModuleDict({"attn": EinsumAttention(32, 2)})
        self.probe = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(x)
        x = self.inner["attn"](x)
        self.probe(x)  # result unused: the matmul still runs and still costs FLOPs
        return self.block(x)


@dataclass
class Case:
    name: str
    factory: Callable[[], nn.Module]
    dims: dict | None
    shapes: st.SearchStrategy  # draws a dict input-name -> tensor shape
    make: Callable[[dict], tuple]  # shapes -> positional inputs


def _floats(shape: tuple) -> torch.Tensor:
    return torch.randn(*shape)


CASES = [
    Case(
        "mlp",
        MLP,
        {"x": {0: "batch", 1: "tokens"}},
        st.fixed_dictionaries({"x": st.tuples(st.integers(1, 6), st.integers(1, 40), st.just(24))}),
        lambda s: (_floats(s["x"]),),
    ),
    Case(
        "cnn",
        CNN,
        {"x": {0: "batch", 2: "height", 3: "width"}},
        st.fixed_dictionaries(
            {"x": st.tuples(st.integers(1, 3), st.just(3), st.integers(6, 30), st.integers(6, 30))}
        ),
        lambda s: (_floats(s["x"]),),
    ),
    Case(
        "gpt",
        lambda: TinyGPT(GPTConfig(vocab=300, hidden=64, heads=4, kv_heads=2, ffn=96, layers=2)),
        None,  # zero-config: every input dim free
        st.fixed_dictionaries({"input_ids": st.tuples(st.integers(1, 4), st.integers(1, 70))}),
        lambda s: (torch.randint(0, 300, s["input_ids"]),),
    ),
    Case(
        "einsum_attention",
        EinsumAttention,
        {"x": {0: "batch", 1: "seq"}},
        # einsum's contraction path relies on seq != 1 (a guard): seq = 1 re-captures, see test_capture
        st.fixed_dictionaries({"x": st.tuples(st.integers(1, 4), st.integers(2, 50), st.just(48))}),
        lambda s: (_floats(s["x"]),),
    ),
    Case(
        "shared_nested",
        Shared,
        {"x": {0: "batch", 1: "seq"}},
        st.fixed_dictionaries({"x": st.tuples(st.integers(1, 4), st.integers(2, 50), st.just(32))}),
        lambda s: (_floats(s["x"]),),
    ),
]
