"""bench/export_scale.py's checkpoint writer: a sharded Hugging Face folder genai reads, written one
shard in memory at a time (the 8B shape's 16 GB never in RAM)."""

from __future__ import annotations

import json
import sys

import torch
from safetensors import safe_open

from bench.export_scale import COMMON, SHAPES, tensor_shapes, write_weights
from bench.harness import run_child
from genai_pipeline.checkpoints import infer_checkpoint_spec


def test_the_index_names_every_tensor_in_the_shard_that_holds_it(tmp_path):
    config = {**COMMON, **SHAPES["tiny"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    written = write_weights(tmp_path, config, seed=0, shard_bytes=4 << 20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    expected = dict(tensor_shapes(config))
    assert "lm_head.weight" not in expected  # tied
    assert set(index["weight_map"]) == set(expected) and written["shards"] > 2
    held, total = {}, 0
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(tmp_path / file, "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                held[name] = file
                total += tensor.numel() * tensor.element_size()
                assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == expected[name]
    assert held == index["weight_map"] and total == index["metadata"]["total_size"] == written["bytes"]
    with safe_open(tmp_path / index["weight_map"]["model.layers.3.mlp.down_proj.weight"], "pt") as f:
        assert abs(f.get_tensor("model.layers.3.mlp.down_proj.weight").float().std().item() - 0.02) < 1e-3
    spec, _ = infer_checkpoint_spec(tmp_path)  # genai reads it as the Llama family, at these sizes
    assert (spec.config.n_layers, spec.config.dim, spec.config.vocab_size) == (4, 256, 49152)


def test_an_untied_shape_has_its_own_head():
    assert tensor_shapes(SHAPES["8b"])[-1] == ("lm_head.weight", (128256, 4096))
    n = sum(torch.Size(shape).numel() for _, shape in tensor_shapes(SHAPES["8b"]))
    assert 8.0e9 < n < 8.1e9  # Llama-3.1-8B's 8.03 B


WRITE_IN_A_CHILD = """
import json, resource, sys
from pathlib import Path
import safetensors.torch, torch  # imported before the baseline: their own memory is not the model's
from bench.export_scale import COMMON, write_weights
config = {**COMMON, **json.loads(sys.argv[2])}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
written = write_weights(Path(sys.argv[1]), config, seed=0, shard_bytes=16 << 20)
print(json.dumps({"growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, **written}))
"""


def test_the_model_is_written_without_holding_it_in_memory(tmp_path):
    shape = {  # ~270 MB of bf16, its biggest tensor 16 MB
        "num_hidden_layers": 8,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8192,
        "tie_word_embeddings": False,
    }
    _, _, printed = run_child([sys.executable, "-c", WRITE_IN_A_CHILD, tmp_path, json.dumps(shape)])
    written = json.loads(printed)
    assert written["bytes"] > 250 << 20 and written["shards"] >= 16
    # one shard, its serialised copy and a tensor; the whole model would be > 250 MB
    assert written["growth_mb"] < 100, written
