"""The typed manifest: manifests written before it (schema 1, checked in as main wrote them) load
with the attributes their readers use, every manifest written is read back the same, and one
the reader cannot take is refused in one line that says to re-export."""

import json
import math

import pytest
from conftest import REPO

from genai_pipeline.errors import ProgramError
from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.manifest import SCHEMA_VERSION, Manifest
from genai_pipeline.models.cache_io import CacheIOContract
from genai_pipeline.names import ArtifactKey, Mode
from genai_pipeline.options import quant_options_from
from genai_pipeline.runtime.multimodal import is_multimodal

# Written before the schema key (main a6fad8f, genai_pipeline 0.2.0): `reference` and `reference-vlm` as `export()`
# writes them by default, `reference` quantized (8da4w, verified) and in the cache-I/O form.
SCHEMA_1 = REPO / "tests" / "manifest-v1"
KINDS = ("reference", "reference-vlm", "reference-8da4w", "reference-cache-io")


def written(kind: str) -> dict:
    return json.loads((SCHEMA_1 / f"{kind}.json").read_text())


@pytest.fixture
def folder(tmp_path):
    """A folder holding the fp32 reference's manifest, as `genai export` left it."""
    (tmp_path / "manifest.json").write_text(json.dumps(written("reference")))
    return tmp_path


def test_a_text_manifest_of_schema_1_loads_with_its_attributes(folder):
    m = Manifest.read(folder)
    assert (m.model, m.entry, m.family, m.recipe, m.target, m.status) == (
        "reference",
        "reference",
        "llama",
        "fp32",
        "xnnpack",
        "complete",
    )
    assert m.mode is Mode.HYBRID and (m.max_seq_len, m.prefill_len) == (512, 32)
    assert (m.config.vocab_size, m.config.n_layers, m.config.dim, m.config.tie_embeddings) == (4096, 4, 256, True)
    assert (m.bos_id, m.eos_ids, m.seed) == (0, (0,), 0)
    decoder = m.artifacts[ArtifactKey.TEXT_DECODER]
    assert decoder.methods == ("prefill", "decode", "prefill_long") and decoder.dynamic_methods == ("prefill_long",)
    assert decoder.constant_methods["get_prefill_len"] == 32 and decoder.qdq is None
    assert m.programs == {ArtifactKey.TEXT_DECODER: "text_decoder.pte"}
    assert m.files["text_decoder.pte"].bytes == 17022592 and len(m.files["text_decoder.pte"].sha256) == 64
    assert m.checkpoint_path.name == "reference" and m.special_tokens["sources"]["bos_id"] == ["generation_config.json"]
    assert m.versions["genai_pipeline"] == "0.2.0" and math.isclose(m.export_seconds, 43.36)
    assert (
        not is_multimodal(m)
        and CacheIOContract.from_manifest(m) is None
        and quant_options_from(m.quantization).is_float
    )
    assert m.vision is m.cache_io is m.decoder_form is m.verification is m.compile_spec is None


def test_a_vision_language_manifest_of_schema_1_loads_with_its_sections():
    m = Manifest.from_json(written("reference-vlm"))
    assert is_multimodal(m) and m.mode is Mode.DYNAMIC and m.config.vocab_size == 4099
    assert m.programs == {ArtifactKey.MULTIMODAL: "multimodal.pte"}
    assert m.artifacts[ArtifactKey.MULTIMODAL].methods == ("token_embedding", "text_decoder", "vision_encoder")
    assert m.vision["layout"] == "one program" and m.vision["image_token_id"] == 4097
    assert ImageProcessing.from_dict(m.vision["preprocessing"]).tokens_per_image == 9


def test_a_quantized_and_a_cache_io_manifest_of_schema_1_load_with_their_sections():
    quantized = Manifest.from_json(written("reference-8da4w"))
    assert quantized.recipe.startswith("8da4w") and quant_options_from(quantized.quantization).recipe == "8da4w"
    assert quantized.verification["tokens"] > 0 and "quant_report.html" in quantized.files
    cache_io = Manifest.from_json(written("reference-cache-io"))
    contract = CacheIOContract.from_manifest(cache_io)
    assert cache_io.decoder_form == "cache-io" and contract.n_layers == 4 and contract.max_seq_len == 128


@pytest.mark.parametrize("kind", KINDS)
def test_a_manifest_is_written_as_it_was_read_with_its_schema(tmp_path, kind):
    """Schema 2 is schema 1 with the key: a manifest read and written again differs by it alone."""
    m = Manifest.from_json(written(kind))
    m.write(tmp_path)
    text = (tmp_path / "manifest.json").read_text()
    assert text.endswith("}\n") and Manifest.read(tmp_path) == m
    assert json.loads(text) == {"schema": SCHEMA_VERSION, **written(kind)}
    assert list(json.loads(text)) == ["schema", *written(kind)]  # the order a reader of the file knows


def test_a_file_added_after_the_export_is_listed(folder):
    (folder / "quant_report.html").write_text("<!doctype html>")
    Manifest.read(folder).with_file(folder, "quant_report.html").write(folder)
    files = Manifest.read(folder).files
    assert files["quant_report.html"].bytes == 15 and list(files) == sorted(files)


def test_a_manifest_of_a_newer_schema_is_refused_in_one_line(folder):
    (folder / "manifest.json").write_text(json.dumps({"schema": SCHEMA_VERSION + 1, "shape": "unknown"}))
    with pytest.raises(ProgramError) as e:
        Manifest.read(folder)
    assert str(e.value) == (
        f"'{folder / 'manifest.json'}' was written by a newer genai_pipeline (schema {SCHEMA_VERSION + 1}); "
        "upgrade, or re-export with this version"
    )


def _artifact(m: dict, **changes) -> dict:
    return {**m, "artifacts": {"text_decoder": {**m["artifacts"]["text_decoder"], **changes}}}


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda m: {**m, "schema": 0}, "schema 0"),
        (lambda m: {**m, "schema": "2"}, 'schema "2"'),
        (lambda m: {**m, "status": "half"}, "status 'half'"),
        (lambda m: {**m, "target": 3}, "'target' is 3"),
        (lambda m: {**m, "config": {**m["config"], "n_heads": 7}}, "config: n_heads (7) must be a multiple"),
        (lambda m: {**m, "artifacts": {}}, "no text_decoder artifact"),
        (lambda m: {**m, "artifacts": {"speech": m["artifacts"]["text_decoder"]}}, "an artifact genai does not export"),
        (lambda m: _artifact(m, file=None), "artifact 'text_decoder' without a program, status complete"),
        (lambda m: _artifact(m, file="gone.pte"), "names a file the manifest does not list"),
        (lambda m: _artifact(m, methods=[1]), "has no file name and method list"),
        (lambda m: _artifact(m, constant_methods=[]), "malformed dynamic methods, constants or QDQ files"),
        (lambda m: {**m, "files": {**m["files"], "../x": m["files"]["tokenizer.json"]}}, "a file outside the folder"),
        (lambda m: {**m, "files": {**m["files"], "tokenizer.json": {"bytes": 1}}}, "without its size and sha256"),
        (lambda m: {**m, "checkpoint": {"path": "/x"}}, "a checkpoint fingerprint without"),
        (lambda m: {**m, "decoder_form": "cache-io"}, "decoder_form 'cache-io' without its cache_io contract"),
        (
            lambda m: {**m, "decoder_form": "cache-io", "cache_io": {"n_layers": 4}},
            "decoder_form 'cache-io' without its cache_io contract",
        ),
        (lambda m: {**m, "decoder_form": "kv-io", "cache_io": {}}, "decoder_form 'kv-io' without"),
        (lambda m: {**m, "vision": {"layout": "one program"}}, "vision without its layout and image token id"),
    ],
)
def test_a_manifest_of_another_shape_is_refused_in_one_line(folder, damage, problem):
    (folder / "manifest.json").write_text(json.dumps(damage(written("reference"))))
    with pytest.raises(ProgramError, match="re-export with this version$") as e:
        Manifest.read(folder)
    assert problem in str(e.value) and "\n" not in str(e.value)
