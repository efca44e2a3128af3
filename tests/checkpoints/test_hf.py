"""The Hugging Face folder loader: sharded files, and one clear error per kind of damage."""

import json

import pytest
import torch
from conftest import save_hf_checkpoint
from safetensors.torch import load_file, save_file

from genai_pipeline.checkpoints.hf import load_decoder
from genai_pipeline.errors import CheckpointError
from genai_pipeline.registry import get_spec

SPEC = get_spec("smollm2-135m")


@pytest.fixture
def checkpoint(tmp_path):
    return save_hf_checkpoint(tmp_path / "ckpt")


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, checkpoint):
    sharded = save_hf_checkpoint(tmp_path / "sharded", max_shard_size="60KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = load_decoder(SPEC, checkpoint, 32).state_dict(), load_decoder(SPEC, sharded, 32).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_loaded_weights_equal_the_file(checkpoint):
    model = load_decoder(SPEC, checkpoint, 32)
    tensors = load_file(checkpoint / "model.safetensors")
    torch.testing.assert_close(model.layers[1].feed_forward.w3.weight, tensors["model.layers.1.mlp.up_proj.weight"])
    torch.testing.assert_close(model.output.weight, tensors["lm_head.weight"])


def _error(folder) -> str:
    with pytest.raises(CheckpointError) as e:
        load_decoder(SPEC, folder, 32)
    return str(e.value)


def test_missing_folder(tmp_path):
    assert "does not exist" in _error(tmp_path / "nope")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    assert "no config.json" in _error(checkpoint)


def test_corrupt_config(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    assert "not valid JSON" in _error(checkpoint)


def test_no_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    assert "no *.safetensors" in _error(checkpoint)


def test_truncated_weights(checkpoint):
    f = checkpoint / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    assert "cannot read" in _error(checkpoint)


def test_shape_mismatch_names_the_tensor(checkpoint):
    f = checkpoint / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, f, metadata={"format": "pt"})
    message = _error(checkpoint)
    assert "model.layers.1.self_attn.k_proj.weight" in message and "(7, 64)" in message


def test_half_precision_is_read_and_integer_weights_are_refused(checkpoint):
    f = checkpoint / "model.safetensors"
    tensors = load_file(f)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, f, metadata={"format": "pt"})
    model = load_decoder(SPEC, checkpoint, 16)
    assert model.layers[0].attention.wq.weight.dtype == torch.float32
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(
        tensors["model.layers.0.self_attn.q_proj.weight"].shape, dtype=torch.int8
    )
    save_file(tensors, f, metadata={"format": "pt"})
    message = _error(checkpoint)
    assert "model.layers.0.self_attn.q_proj.weight" in message and "int8" in message and "float" in message


def test_missing_and_unexpected_tensors_are_named(checkpoint):
    f = checkpoint / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.mlp.extra.weight"] = tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, f, metadata={"format": "pt"})
    assert "model.layers.0.mlp.extra.weight" in _error(checkpoint)
    del tensors["model.layers.0.mlp.extra.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    assert "layers.0.feed_forward.w3.weight" in _error(checkpoint)


def test_config_that_is_not_this_family(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["hidden_size"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert "does not describe a llama model" in _error(checkpoint)


@pytest.mark.parametrize(
    "layers, needle",
    [
        (10**9, "num_hidden_layers is 1000000000, but the tensors hold layers 0 to 1"),
        (2**64 - 1, "but the tensors hold layers 0 to 1"),
        (1, "num_hidden_layers is 1, but the tensors hold layers 0 to 1"),
        (2.5, "num_hidden_layers is 2.5; expected a whole number"),
        ("two", "num_hidden_layers is 'two'; expected a whole number"),
        (0, "num_hidden_layers is 0; expected a whole number"),
    ],
)
def test_a_layer_count_the_tensors_do_not_hold_is_refused_before_building(checkpoint, layers, needle):
    """A config.json declaring a billion layers would build a billion-layer model (a hang, then a
    killed process): it is checked against the safetensors headers first, by loading and by inference."""
    from genai_pipeline.checkpoints import infer_checkpoint_spec

    config = json.loads((checkpoint / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    assert needle in _error(checkpoint)
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        infer_checkpoint_spec(checkpoint)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("rms_norm_eps", float("nan"), "rms_norm_eps is nan; expected a finite number above 0"),
        (
            "rope_parameters",
            {"rope_type": "default", "rope_theta": float("inf")},
            "rope_theta must be a finite number above 0",
        ),
        ("hidden_size", 64.5, "hidden_size is 64.5; expected a whole number >= 1"),
        ("max_position_embeddings", -1, "max_position_embeddings is -1; expected a whole number >= 1"),
        ("rms_norm_eps", "small", "rms_norm_eps is 'small'; expected a finite number above 0"),
    ],
)
def test_non_finite_or_mistyped_hyperparameters_are_refused(checkpoint, key, value, needle):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, key: value}))
    assert needle in _error(checkpoint)


def test_a_nan_weight_is_refused_naming_the_tensor(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, checkpoint / "model.safetensors")
    assert "tensor layers.1.feed_forward.w3.weight holds NaN or Inf values" in _error(checkpoint)
