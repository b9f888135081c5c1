"""Loading errors name what is wrong: missing / unknown / mis-shaped tensors, unknown architectures."""

from __future__ import annotations

import json

import pytest
import torch

from qwen35.checkpoint import CheckpointError
from qwen35.config import Qwen35Config, UnknownArchitectureError
from qwen35.model import Parallel, Shards
from qwen35.standalone import Qwen35Standalone
from qwen35.tiny import TinySpec, checkpoint_tensors, config_json, write_checkpoint


def _write(tmp_path, spec: TinySpec, edit) -> str:
    tensors = checkpoint_tensors(spec)
    edit(tensors)
    return write_checkpoint(tmp_path / "ckpt", spec, tensors)


def test_missing_tensor_is_named(tmp_path):
    path = _write(tmp_path, TinySpec(), lambda t: t.pop("model.layers.1.linear_attn.in_proj_b.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.linear_attn\.in_proj_b\.weight"):
        Qwen35Standalone.from_pretrained(path, max_seqs=1, max_len=8)


def test_missing_per_expert_tensor_is_named(tmp_path):
    spec = TinySpec(moe=True, per_expert=True)
    path = _write(tmp_path, spec, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight$"):
        Qwen35Standalone.from_pretrained(path, max_seqs=1, max_len=8)


def test_wrong_shape_is_named_with_both_shapes(tmp_path):
    def edit(t):
        t["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(64, 128)

    path = _write(tmp_path, TinySpec(), edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight has shape \[64, 128\]; "
                                              r"the config implies \[128, 128\]"):
        Qwen35Standalone.from_pretrained(path, max_seqs=1, max_len=8)


def test_unknown_tensors_are_named(tmp_path):
    def edit(t):
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
        t["model.layers.9.input_layernorm.weight"] = torch.zeros(128)  # beyond num_hidden_layers
        t["model.layers.3.linear_attn.A_log"] = torch.zeros(4)  # layer 3 is full attention

    path = _write(tmp_path, TinySpec(), edit)
    with pytest.raises(CheckpointError, match="unknown tensors") as info:
        Qwen35Standalone.from_pretrained(path, max_seqs=1, max_len=8)
    for name in ("model.layers.0.mlp.extra_proj.weight", "model.layers.9.input_layernorm.weight",
                 "model.layers.3.linear_attn.A_log"):
        assert name in str(info.value)


def test_unknown_architecture(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", TinySpec())
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownArchitectureError, match="unknown architecture 'LlamaForCausalLM'.*Qwen3_5ForCausalLM"):
        Qwen35Standalone.from_pretrained(path, max_seqs=1, max_len=8)
    with pytest.raises(UnknownArchitectureError, match="names no architecture"):
        Qwen35Config.from_dict({k: v for k, v in cfg.items() if k != "architectures"})


def test_config_errors():
    cfg = config_json(TinySpec())
    with pytest.raises(ValueError, match="lacks 'linear_num_value_heads'"):
        Qwen35Config.from_dict({k: v for k, v in cfg.items() if k != "linear_num_value_heads"})
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        Qwen35Config.from_dict({**cfg, "rope_parameters": {**cfg["rope_parameters"], "rope_type": "yarn"}})
    with pytest.raises(ValueError, match="'text_config'"):
        Qwen35Config.from_dict({**cfg, "architectures": ["Qwen3_5ForConditionalGeneration"]})
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide: num_attention_heads=4"):
        Shards.of(Qwen35Config.from_dict(cfg), Parallel(rank=0, size=3))


def test_no_weights_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Qwen35Standalone.from_pretrained(tmp_path, max_seqs=1, max_len=8)
    (tmp_path / "config.json").write_text(json.dumps(config_json(TinySpec())))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        Qwen35Standalone.from_pretrained(tmp_path, max_seqs=1, max_len=8)
