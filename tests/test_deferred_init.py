"""Models bigger than one process: fxpar.deferred_init records a constructor and replays any one
weight bitwise as eager construction made it (checked tensor by tensor against the eager model
for a zoo of real models, including the random stream after construction); fxpar.compile trains
a deferred model, or a meta-device model with init= a safetensors file, a Hugging Face
save_pretrained directory or a torch.distributed.checkpoint, exactly like the eager model; and
inputs it cannot honour fail with errors that say why."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Planted
from safetensors.torch import save_file
from torch import nn
from zoo import CNN

import fxpar
from fxpar.errors import CheckpointError, FxparError
from fxpar.ir.program import named_state
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.deferred import recording_of
from fxpar.runtime.weights import Piece
from fxpar.sharding import all_specs, shard_tensor

transformers = pytest.importorskip("transformers")

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


class _Titan(nn.Module):
    """torchtitan-style: parameters made empty, then one init_weights at the end of __init__
    with per-layer standard deviations and truncated normals."""

    def __init__(self, dim: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.scale = nn.Parameter(torch.empty(dim))
        self.register_buffer("freqs", torch.empty(dim // 2), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.embed.weight)
        for depth, layer in enumerate(self.layers):
            nn.init.trunc_normal_(layer.weight, std=0.02 / (2 * (depth + 1)) ** 0.5)
        nn.init.ones_(self.scale)
        with torch.no_grad():
            self.freqs.copy_(1.0 / (10000 ** (torch.arange(0, self.freqs.numel()) / 8)))


class _Constructed(nn.Module):
    """Weights drawn straight in __init__, an orthogonal init, a view edited in place, a tensor
    computed from another, and a plain tensor attribute (a constant of the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.q = nn.Parameter(torch.empty(5, 5))
        nn.init.orthogonal_(self.q)
        self.emb = nn.Embedding(7, 4, padding_idx=3)
        self.v = nn.Parameter(self.w.detach().sum(0) * 2)
        self.mask = torch.tril(torch.ones(4, 4))


def _hf(name: str, **config: object) -> Callable[[], nn.Module]:
    return lambda: getattr(transformers, name)(getattr(transformers, _CONFIGS[name])(**config))


_CONFIGS = {
    "LlamaForCausalLM": "LlamaConfig",
    "GPT2LMHeadModel": "GPT2Config",
    "BertForMaskedLM": "BertConfig",
    "T5ForConditionalGeneration": "T5Config",
    "ViTForImageClassification": "ViTConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "CLIPModel": "CLIPConfig",
}
_LLAMA = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
)  # fmt: skip

ZOO: dict[str, Callable[[], nn.Module]] = {
    "gpt": lambda: GPT(CONFIG),
    "cnn_batchnorm": CNN,
    "transformer_layer": lambda: nn.TransformerEncoderLayer(16, 4, 32),
    "lstm_padding": lambda: nn.Sequential(nn.Embedding(10, 8, padding_idx=0), nn.LSTM(8, 8)),
    "constructed": _Constructed,
    "torchtitan_style": _Titan,
    "llama": _hf("LlamaForCausalLM", **_LLAMA),
    "gpt2": _hf("GPT2LMHeadModel", vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4),
    "bert": _hf(
        "BertForMaskedLM",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    ),
    "t5": _hf(
        "T5ForConditionalGeneration",
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
    ),
    "vit_trunc_normal": _hf(
        "ViTForImageClassification",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=8,
    ),
    "mixtral_moe": _hf("MixtralForCausalLM", **_LLAMA, num_local_experts=4),
    "clip": _hf(
        "CLIPModel",
        text_config=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            image_size=16,
            patch_size=8,
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_replay_equals_eager_construction(name: str) -> None:
    factory = ZOO[name]
    torch.manual_seed(3)
    eager = factory()
    after_eager = torch.rand(4)
    torch.manual_seed(3)
    deferred = fxpar.deferred_init(factory)
    after_deferred = torch.rand(4)
    assert torch.equal(after_eager, after_deferred), "the generator must end where eager left it"
    recording = recording_of(deferred)
    assert recording is not None
    deferred_state = named_state(deferred)
    for key, tensor in named_state(eager).items():
        if deferred_state[key].is_meta:
            replayed = recording.materialize(key)
            assert replayed.dtype == tensor.dtype and replayed.shape == tensor.shape, key
            assert torch.equal(replayed, tensor.detach()), key
        else:  # made from a Python value (torch.tensor(...)): kept as it was built
            assert torch.equal(deferred_state[key], tensor), key
    assert any(t.is_meta for t in deferred_state.values())
    for module, eager_module in zip(deferred.modules(), eager.modules(), strict=True):
        for attribute, value in vars(eager_module).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(module, attribute), value), attribute


def test_tied_weights_stay_tied() -> None:
    model = fxpar.deferred_init(GPT, CONFIG)
    assert model.head.weight is model.wte.weight and model.wte.weight.is_meta


def test_recording_errors() -> None:
    def own_generator() -> nn.Module:
        layer = nn.Linear(2, 2)
        nn.init.normal_(layer.weight, generator=torch.Generator().manual_seed(0))
        return layer

    with pytest.raises(FxparError, match=r"its own torch\.Generator"):
        fxpar.deferred_init(own_generator)
    with pytest.raises(FxparError, match=r"not an nn\.Module"):
        fxpar.deferred_init(lambda: torch.zeros(2))  # type: ignore[arg-type, return-value]
    with pytest.raises(FxparError, match="not made while recording"):
        recording = recording_of(fxpar.deferred_init(GPT, CONFIG))
        assert recording is not None
        recording.materialize("no.such.weight")


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2), (3, 2)])
def test_piece_slices_are_the_shards(mesh: tuple[int, ...]) -> None:
    whole = torch.arange(7 * 8 * 6).reshape(7, 8, 6)
    for spec in all_specs(whole.shape, mesh):
        for coordinate in itertools.product(*(range(size) for size in mesh)):
            piece = Piece(spec, mesh, coordinate)
            assert torch.equal(piece.of(whole), shard_tensor(whole, spec, mesh, coordinate))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator),
        torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator),
    )


def _eager_losses(model: nn.Module, steps: int = 3) -> list[float]:
    tokens, targets = _batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = gpt_loss(model(tokens), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _fxpar_losses(model: nn.Module, init: object = None, steps: int = 3) -> list[float]:
    tokens, targets = _batch()
    parallel = fxpar.compile(
        model, fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
        optimizer=fxpar.optim.SGD(lr=0.1), init=init,  # type: ignore[arg-type]
    )  # fmt: skip
    return [float(parallel.step(tokens, targets)) for _ in range(steps)]


def test_compile_trains_a_deferred_model_like_the_eager_one() -> None:
    torch.manual_seed(5)
    expected = _eager_losses(GPT(CONFIG))
    torch.manual_seed(5)
    assert _fxpar_losses(fxpar.deferred_init(GPT, CONFIG)) == expected


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(CONFIG)


def test_compile_loads_a_safetensors_file_and_a_dcp_directory(tmp_path: Path) -> None:
    torch.manual_seed(6)
    eager = GPT(CONFIG)
    state = {k: v.detach().clone() for k, v in eager.state_dict().items()}
    del state["head.weight"]  # saved once, under the embedding's name, as HF does
    save_file(state, str(tmp_path / "weights.safetensors"))
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    expected = _eager_losses(eager)
    assert _fxpar_losses(_meta_gpt(), tmp_path / "weights.safetensors") == expected
    assert _fxpar_losses(_meta_gpt(), tmp_path / "dcp") == expected


def test_weights_from_a_dcp_directory_run_no_code(tmp_path: Path) -> None:
    """``init=`` a DCP directory reads its ``.metadata`` as checkpoints are read: one that would
    run code on unpickling is refused, naming the file, and runs nothing."""
    state = {k: v.detach().clone() for k, v in GPT(CONFIG).state_dict().items()}
    del state["head.weight"]
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    marker = tmp_path / "marker"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Planted(str(marker))))
    with pytest.raises(CheckpointError, match=r"\.metadata.*not part of a checkpoint"):
        _fxpar_losses(_meta_gpt(), tmp_path / "dcp")
    assert not marker.exists()


def test_compile_loads_hugging_face_save_pretrained(tmp_path: Path) -> None:
    factory = ZOO["llama"]
    torch.manual_seed(7)
    eager = factory()
    eager.save_pretrained(tmp_path / "one")
    eager.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids}
    reference = eager(**batch).loss.item()
    with torch.device("meta"):
        meta = factory()
    # The rotary embedding's frequencies are buffers save_pretrained leaves out.
    with pytest.raises(FxparError, match=r"not in .*\('model.rotary_emb.inv_freq'"):
        fxpar.compile(meta, fxpar.Cluster((1,)), batch, init=tmp_path / "one")
    for directory in ("one", "sharded"):
        # A deferred model makes what the checkpoint lacks; its weights come from the file.
        torch.manual_seed(8)
        deferred = fxpar.deferred_init(factory)
        parallel = fxpar.compile(deferred, fxpar.Cluster((1,)), batch, init=tmp_path / directory)
        assert parallel.loss(**batch).item() == pytest.approx(reference, rel=1e-6)
        full = parallel.full_state_dict()
        for key, tensor in eager.state_dict().items():
            assert torch.equal(full[key], tensor), key


def test_missing_sources_fail_before_planning(tmp_path: Path) -> None:
    tokens, targets = _batch()

    def compile_(model: nn.Module, init: object = None) -> object:
        return fxpar.compile(
            model, fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
            init=init,  # type: ignore[arg-type]
        )  # fmt: skip

    with pytest.raises(FxparError, match=r"tensors on the meta device \('wte.weight'"):
        compile_(_meta_gpt())
    partial = {
        k: v.clone() for k, v in GPT(CONFIG).state_dict().items() if not k.startswith("blocks.1")
    }
    save_file(partial, str(tmp_path / "partial.safetensors"))
    with pytest.raises(FxparError, match=r"are not in .*partial.safetensors \('blocks.1"):
        compile_(_meta_gpt(), tmp_path / "partial.safetensors")
    wide = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=64, block_size=16))
    save_file(
        {k: v.clone() for k, v in wide.state_dict().items()}, str(tmp_path / "wide.safetensors")
    )
    with pytest.raises(CheckpointError, match=r"has shape \(64, 64\) but the model's 'wte.weight'"):
        compile_(_meta_gpt(), tmp_path / "wide.safetensors")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        compile_(_meta_gpt(), tmp_path / "nowhere.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"holds neither model\.safetensors"):
        compile_(_meta_gpt(), tmp_path / "empty")
