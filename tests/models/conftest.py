"""Session fixtures of the tiny SmolVLM checkpoint (tests/models/test_vision.py builds it), shared
by the vision-language tests of this folder so that each program is exported once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_vision import IMAGE, MAX_SEQ, photo, save_tiny_smolvlm, write_ppm

from genai_pipeline.registry import infer_spec


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm"))


@pytest.fixture(scope="session")
def reference(checkpoint):
    import transformers

    return transformers.Idefics3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


def export_vlm(checkpoint: Path, out: Path, **options) -> Path:
    """The tiny checkpoint exported (fp32, xnnpack) with PrepareOptions `options`."""
    from genai_pipeline.compile import compile_artifacts
    from genai_pipeline.prepare import PrepareOptions, prepare
    from genai_pipeline.targets import get_target

    spec = infer_spec(json.loads((checkpoint / "config.json").read_text()))
    compile_artifacts(prepare(spec, PrepareOptions(max_seq_len=MAX_SEQ, checkpoint=checkpoint, **options)), get_target("xnnpack"), out)
    return out


@pytest.fixture(scope="session")
def program(checkpoint, tmp_path_factory) -> Path:
    """The default layout, exported once: one program, three methods."""
    return export_vlm(checkpoint, tmp_path_factory.mktemp("smolvlm-program"))


@pytest.fixture(scope="session")
def split_program(checkpoint, tmp_path_factory):
    """split_program(mode) -> folder: the --split layout, each mode exported once. Prefill chunks of
    8 tokens: a prompt with an image (about 15 tokens) ends in a partial chunk."""
    built: dict[str, Path] = {}

    def build(mode: str) -> Path:
        if mode not in built:
            built[mode] = export_vlm(checkpoint, tmp_path_factory.mktemp(f"smolvlm-split-{mode}"), split=True, mode=mode, prefill_len=8)
        return built[mode]

    return build


@pytest.fixture(scope="session")
def image_file(tmp_path_factory) -> Path:
    return write_ppm(tmp_path_factory.mktemp("images") / "photo.ppm", photo(IMAGE, IMAGE))
