"""Hypothesis strategies for property tests: small models, meshes and valid plans.

A user who writes a pass or a rule can check that every plan still trains exactly like one
device::

    from hypothesis import given
    from fxpar.testing import strategies as fst
    from fxpar.testing import assert_plan_equivalent

    @given(case=fst.models(), cluster=fst.clusters(), seed=fst.plan_seeds())
    def test_my_rule(case, cluster, seed):
        assert_plan_equivalent(case, cluster, seed, rules=my_rules)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from fxpar.cluster import Cluster


@dataclass
class ModelCase:
    """A model with example inputs, loss function and targets, ready for fxpar.capture."""

    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[..., torch.Tensor]
    targets: tuple[torch.Tensor, ...] = field(default=())

    def __repr__(self) -> str:
        return f"ModelCase({self.name})"


# Sizes divisible by 2, 3 and 4 so that meshes of up to 4 devices have sharding options.
WIDTHS = (12, 24)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, self.heads, 3, -1).unbind(3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class _RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def _sequence_block(kind: str, width: int) -> nn.Module:
    if kind == "linear":
        return nn.Linear(width, width)
    if kind == "mlp":
        return _Residual(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        )
    if kind == "attention":
        return _Residual(_Attention(width, heads=2, causal=True))
    if kind == "layernorm":
        return nn.LayerNorm(width)
    if kind == "rmsnorm":
        return _RMSNorm(width)
    if kind == "tanh":
        return nn.Tanh()
    if kind == "dropout":
        return nn.Dropout(0.25)
    raise ValueError(kind)


SEQUENCE_BLOCKS = ("linear", "mlp", "attention", "layernorm", "rmsnorm", "tanh", "dropout")


class _SequenceModel(nn.Module):
    def __init__(self, vocab: int, width: int, blocks: Sequence[str], classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(_sequence_block(kind, width) for kind in blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


class _ImageModel(nn.Module):
    def __init__(self, channels: int, pool: str, norm: bool, classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(4, channels, 3, padding=1)]
        if norm:
            layers.append(nn.BatchNorm2d(channels))
        layers += [nn.ReLU(), nn.MaxPool2d(2) if pool == "max" else nn.AvgPool2d(2)]
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.AdaptiveAvgPool2d(1)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _square_loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().sum(-1).mean()


@st.composite
def sequence_models(draw: st.DrawFn) -> ModelCase:
    """Token models: embedding, 1-3 blocks among linear, residual MLP, causal attention,
    LayerNorm, RMSNorm (a reduction), tanh and dropout (random inputs), a linear head;
    cross-entropy or a square loss."""
    width = draw(st.sampled_from(WIDTHS))
    blocks = draw(st.lists(st.sampled_from(SEQUENCE_BLOCKS), min_size=1, max_size=3))
    batch, length, vocab, classes = draw(st.sampled_from((4, 12))), 4, 16, 12
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    model = _SequenceModel(vocab, width, blocks, classes)
    tokens = torch.randint(0, vocab, (batch, length))
    name = f"sequence(width={width}, blocks={blocks}, batch={batch})"
    if draw(st.booleans()):
        targets = torch.randint(0, classes, (batch, length))
        return ModelCase(name, model, (tokens,), _token_loss, (targets,))
    return ModelCase(name + " square loss", model, (tokens,), _square_loss)


@st.composite
def image_models(draw: st.DrawFn) -> ModelCase:
    """Small CNNs: convolution, optional BatchNorm, ReLU, max or average pooling, adaptive
    pooling, a linear classifier, cross-entropy."""
    channels = draw(st.sampled_from((4, 8)))
    pool = draw(st.sampled_from(("max", "avg")))
    norm = draw(st.booleans())
    batch = draw(st.sampled_from((4, 12)))
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    model = _ImageModel(channels, pool, norm, classes=4)
    images = torch.randn(batch, 4, 8, 8)
    labels = torch.randint(0, 4, (batch,))
    name = f"image(channels={channels}, pool={pool}, batchnorm={norm}, batch={batch})"
    return ModelCase(name, model, (images,), F.cross_entropy, (labels,))


def models() -> st.SearchStrategy[ModelCase]:
    """Random small models of either family."""
    return st.one_of(sequence_models(), image_models())


MESHES = ((1,), (2,), (3,), (4,), (1, 2), (2, 1), (2, 2))

SPLITTING = {"latency": (1e-9,), "bandwidth": (1e9,)}
"""Cluster overrides for links whose collectives cost their bytes but almost no latency. Under
the default costs a model as small as a test's runs fastest whole on every device, so the ILP
rightly plans it replicated; on these links it splits tensors, which is what a test of its plans
needs."""


def splitting_cluster(mesh: tuple[int, ...]) -> Cluster:
    """A cluster of ``mesh`` with :data:`SPLITTING` links: the ILP splits even tiny models."""
    return Cluster(mesh, **SPLITTING)  # type: ignore[arg-type]


def clusters(meshes: Sequence[tuple[int, ...]] = MESHES) -> st.SearchStrategy[Cluster]:
    """Meshes of 1 to 4 devices, 1-D and 2-D, with the default costs or :data:`SPLITTING`
    links (the costs decide the ILP's plans, not what a plan may do)."""
    return st.sampled_from(
        [Cluster(mesh) for mesh in meshes] + [splitting_cluster(mesh) for mesh in meshes]
    )


def plan_seeds() -> st.SearchStrategy[int]:
    """Seeds for :func:`fxpar.plans.random_plan`."""
    return st.integers(0, 2**31 - 1)
