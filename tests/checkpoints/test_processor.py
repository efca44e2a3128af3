"""A checkpoint's image-processor settings read in both layouts transformers writes, for every
vision family: flat in preprocessor_config.json (an image processor's own `save_pretrained`, and
transformers 4.x processors), and nested under `image_processor` in processor_config.json (a
transformers 5.x processor's `save_pretrained`). The files are saved by transformers itself; our
frames are compared pixel for pixel with transformers' processor loaded from the same folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from genai_pipeline.checkpoints.processor import ProcessorFiles, image_processing
from genai_pipeline.cli import main
from genai_pipeline.image_processing import image_frames
from genai_pipeline.prepare.multimodal import read_processing
from genai_pipeline.registry import get_spec, infer_spec
from genai_pipeline.registry.internvl import IMAGENET_MEAN, IMAGENET_STD
from genai_pipeline.registry.llava import CLIP_MEAN, CLIP_STD

FAMILIES = ("smolvlm-256m", "internvl3-1b", "llava-1_5-7b")
LAYOUTS = ("preprocessor_config.json", "processor_config.json")
TILE = 32
SPECIALS = ["<unk>", "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]


def image_processor(entry: str):
    """transformers' PIL image processor of the family, at a tiny tile size (resizes and splits)."""
    if entry == "smolvlm-256m":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        return Idefics3ImageProcessorPil(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE})
    if entry == "internvl3-1b":
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        return GotOcr2ImageProcessorPil(
            size={"height": TILE, "width": TILE},
            crop_to_patches=True,
            max_patches=4,
            image_mean=IMAGENET_MEAN,
            image_std=IMAGENET_STD,
        )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": TILE + 8}, crop_size={"height": TILE, "width": TILE})


def save_processor(entry: str, layout: str, folder: Path) -> Path:
    """The family's processor files as transformers writes them in that layout."""
    import transformers
    from tokenizers import Tokenizer, models

    image = image_processor(entry)
    if layout == "preprocessor_config.json":
        image.save_pretrained(folder)
        return folder
    if entry == "internvl3-1b":
        # InternVLProcessor takes a video processor, which needs torchvision (not a dependency): its
        # file is written as ProcessorMixin.to_json_string writes it, the image processor's `to_dict()`
        # nested under `image_processor`.
        folder.mkdir(parents=True, exist_ok=True)
        processor = {"image_processor": image.to_dict(), "image_seq_length": 4, "processor_class": "InternVLProcessor"}
        (folder / "processor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")
        return folder
    vocab = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS)}, unk_token="<unk>"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=vocab, unk_token="<unk>")
    if entry == "smolvlm-256m":
        processor = transformers.Idefics3Processor(image_processor=image, tokenizer=tokenizer, image_seq_len=4)
    else:
        processor = transformers.LlavaProcessor(image_processor=image, tokenizer=tokenizer, patch_size=8)
    processor.save_pretrained(folder)
    return folder


def test_transformers_5_writes_the_image_settings_nested_in_processor_config(tmp_path):
    """The layout this reader exists for: if transformers stops writing it, this fails first."""
    folder = save_processor("smolvlm-256m", "processor_config.json", tmp_path)
    assert not (folder / "preprocessor_config.json").exists()
    written = json.loads((folder / "processor_config.json").read_text())
    assert written["image_processor"]["max_image_size"] == {"longest_edge": TILE}
    assert written["image_seq_len"] == 4


FRAMES = {"smolvlm-256m": 5, "internvl3-1b": 3, "llava-1_5-7b": 1}  # of a 45 x 70 image: 2 x 2 or 1 x 2 tiles + global
EXPECTED = {  # ImageProcessing fields the files above state, per family
    "smolvlm-256m": dict(tile_size=TILE, longest_edge=2 * TILE, resample=1, image_mean=(0.5,) * 3),
    "internvl3-1b": dict(tile_size=TILE, max_tiles=4, min_tiles=1, do_image_splitting=True, image_mean=IMAGENET_MEAN),
    "llava-1_5-7b": dict(tile_size=TILE, shortest_edge=TILE + 8, resample=3, image_mean=CLIP_MEAN, image_std=CLIP_STD),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entry", FAMILIES)
def test_both_layouts_read_as_transformers_reads_them(entry, layout, tmp_path):
    from PIL import Image

    folder = save_processor(entry, layout, tmp_path)
    files = ProcessorFiles.read(folder)
    assert files.origin.startswith(f"'{folder / layout}'")
    ours = image_processing(get_spec(entry).vision.preprocessing, files)
    for name, value in EXPECTED[entry].items():
        assert getattr(ours, name) == value, name
    nested = layout == "processor_config.json"
    assert files.tokens_per_image == ((16 if entry == "llava-1_5-7b" else 4) if nested else None)

    # transformers' own processor loaded from the same folder gives the same frames
    theirs = type(image_processor(entry)).from_pretrained(folder)
    rng = np.random.default_rng(0)
    photo = np.clip(np.linspace(0, 255, 45 * 70 * 3).reshape(45, 70, 3) + rng.normal(0, 20, (45, 70, 3)), 0, 255)
    photo = photo.astype(np.uint8)
    out = theirs.preprocess(Image.fromarray(photo))
    expected = np.asarray(out["pixel_values"]).reshape(-1, 3, TILE, TILE)
    frames = image_frames(photo, ours)
    mean, std = (np.reshape(v, (1, 3, 1, 1)) for v in (ours.image_mean, ours.image_std))
    got = (np.stack(frames.pixels) / 255.0 - mean) / std
    assert got.shape == expected.shape and len(frames.pixels) == FRAMES[entry]
    assert np.abs(got - expected).max() <= 1e-5


def test_processor_config_wins_over_preprocessor_config(tmp_path):
    """Both files present: processor_config.json's image_processor, as transformers reads them."""
    save_processor("smolvlm-256m", "processor_config.json", tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_image_size": {"longest_edge": 512}}))
    assert (
        image_processing(get_spec("smolvlm-256m").vision.preprocessing, ProcessorFiles.read(tmp_path)).tile_size == TILE
    )


def tiny_smolvlm_config(folder: Path, tower: int) -> Path:
    """config.json alone (no weights): the processor's settings are read and checked before them."""
    import transformers

    transformers.Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=tower,
            patch_size=8,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=64,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
        ),
        scale_factor=2,
    ).save_pretrained(folder)
    return folder


def test_nested_settings_of_a_small_tower_are_its_own_not_the_entrys(tmp_path):
    """The case that was refused: a 64 px tower, saved the 5.x way, read with the entry's 512 px tiles."""
    folder = tiny_smolvlm_config(tmp_path, tower=2 * TILE)
    save_processor("smolvlm-256m", "processor_config.json", folder)
    written = json.loads((folder / "processor_config.json").read_text())
    written["image_processor"]["max_image_size"] = {"longest_edge": 2 * TILE}
    written["image_seq_len"] = 16
    (folder / "processor_config.json").write_text(json.dumps(written))
    processing, vision = read_processing(infer_spec(json.loads((folder / "config.json").read_text())), folder)
    assert (processing.tile_size, vision.image_size, processing.tokens_per_image) == (2 * TILE, 2 * TILE, 16)


def _export_error(folder: Path, tmp_path: Path, capsys) -> str:
    assert main(["export", "--checkpoint", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    return err[-1]


def test_settings_that_contradict_the_tower_are_one_line_naming_the_file(tmp_path, capsys):
    folder = tiny_smolvlm_config(tmp_path / "ckpt", tower=2 * TILE)
    save_processor("smolvlm-256m", "processor_config.json", folder)
    message = _export_error(folder, tmp_path, capsys)
    assert f"tiles are {TILE} px ('{folder / 'processor_config.json'}' (image_processor))" in message
    assert f"the image tower takes {2 * TILE} px (config.json's vision_config.image_size)" in message


def test_image_tokens_that_contradict_the_tower_are_one_line(tmp_path, capsys):
    folder = tiny_smolvlm_config(tmp_path / "ckpt", tower=2 * TILE)
    save_processor("smolvlm-256m", "processor_config.json", folder)
    written = json.loads((folder / "processor_config.json").read_text())
    written["image_processor"]["max_image_size"] = {"longest_edge": 2 * TILE}  # the tower's tiles: 16 tokens
    (folder / "processor_config.json").write_text(json.dumps(written))  # image_seq_len: still 4
    message = _export_error(folder, tmp_path, capsys)
    assert "expands an image into 4 tokens" in message and "image tower makes 16" in message


@pytest.mark.parametrize(
    "text,expected",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "holds a JSON list"),
        ('{"image_processor": "Idefics3ImageProcessor"}', "image_processor is a str"),
        ('{"image_processor": {"max_image_size": 512}}', "holds image settings this pipeline cannot read"),
        ('{"image_seq_len": "many"}', "image_seq_len is 'many', not a positive number"),
    ],
)
def test_a_damaged_processor_config_is_one_line(text, expected, tmp_path, capsys):
    folder = tiny_smolvlm_config(tmp_path / "ckpt", tower=2 * TILE)
    (folder / "processor_config.json").write_text(text)
    message = _export_error(folder, tmp_path, capsys)
    assert expected in message and "processor_config.json" in message


def test_no_processor_files_keep_the_entrys_defaults(tmp_path):
    files = ProcessorFiles.read(tmp_path)
    assert files.image == {} and files.tokens_per_image is None and "entry's defaults" in files.origin
    spec = get_spec("internvl3-1b")
    assert image_processing(spec.vision.preprocessing, files) == spec.vision.preprocessing


def save_feature_extractor(layout: str, folder: Path, **settings) -> Path:
    """Whisper's feature extractor as transformers writes it: flat (its own `save_pretrained`), or
    nested under `feature_extractor` (a 5.x processor's: WhisperProcessor, which needs no Mistral
    tokenizer as VoxtralProcessor does)."""
    import transformers
    from tokenizers import Tokenizer, models

    extractor = transformers.WhisperFeatureExtractor(**settings)
    if layout == "preprocessor_config.json":
        extractor.save_pretrained(folder)
        return folder
    vocab = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=vocab)
    transformers.WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(folder)
    assert "feature_extractor" in json.loads((folder / "processor_config.json").read_text())
    return folder


@pytest.mark.parametrize("layout", LAYOUTS)
def test_audio_feature_extractor_read_in_both_layouts(layout, tmp_path):
    from genai_pipeline.checkpoints.processor import audio_processing

    files = ProcessorFiles.read(save_feature_extractor(layout, tmp_path, feature_size=80, chunk_length=2))
    defaults = get_spec("voxtral-mini-3b").audio.preprocessing
    processing = audio_processing(defaults, files)
    assert (processing.feature_size, processing.chunk_length, processing.chunk_frames) == (80, 2, 200)
    assert (defaults.feature_size, defaults.chunk_frames) == (128, 3000) and layout in files.audio_origin


def test_a_feature_extractor_this_pipeline_would_not_match_is_refused(tmp_path):
    from genai_pipeline.checkpoints.processor import audio_processing
    from genai_pipeline.errors import CheckpointError

    defaults = get_spec("voxtral-mini-3b").audio.preprocessing
    for stated in (
        {"feature_extractor_type": "WhisperFeatureExtractor", "do_normalize": True},
        {"feature_extractor_type": "SeamlessM4TFeatureExtractor"},
    ):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(stated))
        with pytest.raises(CheckpointError, match="Whisper's log-mel features"):
            audio_processing(defaults, ProcessorFiles.read(tmp_path))
