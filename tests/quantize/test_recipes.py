"""quantize/recipes.py: a recipe as an ordered rule list (first match wins), the rules put before it
(--quant-override, a size budget's promotions, given int4 weights), and eval applying the rules an
export recorded."""

import copy
import dataclasses
import json

import pytest
import torch
from conftest import REPO

from genai_pipeline.errors import InputError
from genai_pipeline.evaluate.text import quantized_model
from genai_pipeline.layer_rules import Rule, recipe_of, rules_naming
from genai_pipeline.manifest import Manifest
from genai_pipeline.options import PrepareOptions, QuantOptions, quant_options_from
from genai_pipeline.prepare import prepare
from genai_pipeline.quantize import quantize
from genai_pipeline.quantize.recipes import (
    BLOCKS,
    HEAD,
    TABLE_8BIT_SHARE,
    TABLE_8BIT_SHARE_ROTATED_INPUTS,
    describe,
    for_decoder,
    linear_recipes,
    recipe_rules,
    rules_for,
    split_tied_table,
    table_8bit_rows,
)
from genai_pipeline.quantize.weights import linear_bytes
from genai_pipeline.registry import get_spec
from genai_pipeline.targets import get_target

KINDS = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp), as it is written there: the layers whose attn_v and
    ffn_down Q4_K_M stores at 6 bits."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def plan(rules, n_layers: int) -> dict[str, str]:
    names = ["output", "head_rotation"] + [f"layers.{i}.{k}" for i in range(n_layers) for k in KINDS]
    return {name: recipe_of(name, rules) for name in names}


@pytest.mark.parametrize("n_layers", [2, 4, 15, 16, 22, 30, 32])
def test_8da4w_rules_give_each_layer_what_the_decisions_say(n_layers):
    edge = n_layers // 15  # w1 / w3 of the first and last 1/15 of the blocks (docs/decisions/0016)
    want = {"output": "8da4w", "head_rotation": "fp32"}  # GPTQ quantizes the head; rotation's linear stays float
    for i in range(n_layers):
        for kind in KINDS:
            eight = (
                kind == "attention.wv"  # every block (docs/decisions/0011)
                or kind == "feed_forward.w2"
                and use_more_bits(i, n_layers)  # docs/decisions/0020
                or kind in ("feed_forward.w1", "feed_forward.w3")
                and (i < edge or i >= n_layers - edge)
            )
            want[f"layers.{i}.{kind}"] = "8da8w" if eight else "8da4w"
    assert plan(rules_for(QuantOptions(recipe="8da4w"), n_layers), n_layers) == want
    # uncalibrated 4-bit weights keep the head at 8 bits (docs/decisions/0011)
    assert plan(rules_for(QuantOptions(recipe="8da4w", weight_rule="mse"), n_layers), n_layers)["output"] == "8da8w"


def test_the_more_bits_layers_of_known_depths():
    rules = rules_for(QuantOptions(recipe="8da4w"), 30)
    w2 = {i for i in range(30) if recipe_of(f"layers.{i}.feed_forward.w2", rules) == "8da8w"}
    assert w2 == {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}  # SmolLM2-135M
    w1 = {i for i in range(30) if recipe_of(f"layers.{i}.feed_forward.w1", rules) == "8da8w"}
    assert w1 == {0, 1, 28, 29}
    # a band of no blocks is no rule: below 15 layers there are no edge layers
    assert not any("w[13]" in r.pattern for r in rules_for(QuantOptions(recipe="8da4w"), 4))


@pytest.mark.parametrize("recipe", ["fp32", "8da8w"])
def test_the_other_dynamic_recipes_are_one_recipe_but_the_head_rotation(recipe):
    assert rules_for(QuantOptions(recipe=recipe), 30) == (Rule("^head_rotation$", "fp32"), Rule(".*", recipe))


def test_a_static_recipe_has_no_rules():
    assert rules_for(QuantOptions(recipe="8a8w"), 30) == ()  # the target's quantizer annotates every layer


def test_overrides_and_a_budgets_promotions_come_first():
    promoted = ("layers.0.attention.wq", "layers.3.attention.wq", "layers.1.feed_forward.w2")
    options = QuantOptions(
        recipe="8da4w", size_budget=50, promoted=promoted, overrides=((r"^layers\.0\.", "8da4w"), ("w3", "fp32"))
    )
    rules = rules_for(options, 4)
    assert rules[:2] == (Rule(r"^layers\.0\.", "8da4w"), Rule("w3", "fp32"))
    assert (
        rules[2:4]
        == rules_naming(promoted, "8da8w")
        == (
            Rule(r"^layers\.\d+\.attention\.wq$", "8da8w", (0, 3)),
            Rule(r"^layers\.\d+\.feed_forward\.w2$", "8da8w", (1,)),
        )
    )
    assert rules[4:] == recipe_rules(options, 4)
    recipes = plan(rules, 4)
    assert recipes["layers.0.attention.wq"] == "8da4w"  # the override outranks the promotion
    assert recipes["layers.3.attention.wq"] == recipes["layers.1.feed_forward.w2"] == "8da8w"
    assert recipes["layers.2.feed_forward.w3"] == "fp32"
    # under a budget the measurement replaces the recipe's 8-bit block layers
    assert recipes["layers.2.attention.wv"] == recipes["layers.3.feed_forward.w2"] == "8da4w"
    # without one, an override still outranks them
    assert (
        plan(rules_for(QuantOptions(recipe="8da4w", overrides=(("w1", "8da4w"),)), 30), 30)["layers.0.feed_forward.w1"]
        == "8da4w"
    )


def test_given_int4_weights_outrank_the_recipes_8_bit_layers_not_an_override():
    given = ["layers.0.attention.wv", "layers.0.attention.wq", "layers.1.attention.wv", "output"]
    options = QuantOptions(recipe="8da4w", weight_rule="mse", overrides=((r"layers\.1\.attention\.wv", "8da8w"),))
    rules = rules_for(options, 4, given)
    # only the layers the recipe would not give 8da4w need a rule of their own
    assert rules[1:3] == (Rule("^output$", "8da4w"), Rule(r"^layers\.\d+\.attention\.wv$", "8da4w", (0,)))
    recipes = plan(rules, 4)
    assert recipes["layers.0.attention.wv"] == recipes["output"] == "8da4w"
    assert recipes["layers.1.attention.wv"] == "8da8w" and recipes["layers.2.attention.wv"] == "8da8w"
    assert rules_for(QuantOptions(recipe="8da8w"), 4, given)[-1] == Rule(".*", "8da8w")  # 8da8w takes none


def test_rules_are_checked_and_read_back_from_their_manifest_form():
    options = QuantOptions(recipe="8da4w", rules=[{"pattern": "wv", "recipe": "8da8w", "layers": [3, 1, 1]}])
    assert options.rules == (Rule("wv", "8da8w", (1, 3)),)
    assert rules_for(options, 30) == options.rules  # a whole rule list: taken as it is
    for bad in (
        dict(rules=[{"pattern": "(", "recipe": "8da8w"}]),
        dict(rules=[Rule("x", "4w")]),
        dict(recipe="8a8w", rules=[Rule(".*", "8da8w")]),
    ):
        with pytest.raises(InputError):
            QuantOptions(**{"recipe": "8da4w", **bad})
    assert not Rule("wv", "8da8w", (1,)).matches("layers.2.attention.wv") and Rule("wv", "8da8w", (2,)).matches(
        "layers.2.attention.wv"
    )


@pytest.fixture(scope="module")
def recorded():
    """The reference model quantized by 8da4w without calibration (fast), and its manifest's
    `quantization` entry as a manifest holds it (through JSON)."""
    prepared = prepare(get_spec("reference"), PrepareOptions(mode="kv", max_seq_len=64))
    reference = copy.deepcopy(next(iter(prepared.artifacts.values())).module)  # quantize works in place
    options = QuantOptions(recipe="8da4w", weight_rule="mse", smooth=None, rotate=False)
    quantized = quantize(prepared, options, get_target("xnnpack"))
    return reference, json.loads(json.dumps(quantized.quantization))


def _manifest(quantization: dict) -> Manifest:
    """The reference model's manifest (as main wrote it before the schema key) recording `quantization`."""
    written = json.loads((REPO / "tests" / "manifest-v1" / "reference.json").read_text())
    return Manifest.from_json({**written, "quantization": quantization})


def _formats(model) -> dict[str, str]:
    return {
        n: str(getattr(m.weight, "target_dtype", "float"))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def test_the_manifest_records_the_rules_and_eval_applies_exactly_those(recorded, tmp_path):
    reference, quantization = recorded
    rules = rules_for(QuantOptions(recipe="8da4w", weight_rule="mse"), len(reference.layers))
    assert quantization["rules"] == [dataclasses.asdict(r) | {"layers": r.layers and list(r.layers)} for r in rules]
    assert quant_options_from(quantization).rules == rules
    rebuilt = _formats(quantized_model(tmp_path, _manifest(quantization), reference))
    assert rebuilt["layers.0.attention.wv"] == rebuilt["output"] == "torch.int8"
    assert rebuilt["layers.0.attention.wq"] == "torch.int4"

    edited = json.loads(json.dumps(quantization))  # by hand: wv at 4 bits, one layer left float
    next(r for r in edited["rules"] if "wv" in r["pattern"])["recipe"] = "8da4w"
    edited["rules"].insert(0, {"pattern": r"^layers\.1\.attention\.wq$", "recipe": "fp32", "layers": None})
    changed = _formats(quantized_model(tmp_path, _manifest(edited), reference))
    want = {n: "torch.int4" if n.endswith("attention.wv") else f for n, f in rebuilt.items()}
    assert changed == want | {"layers.1.attention.wq": "float"}


def test_a_manifest_without_rules_evaluates_as_before(recorded, tmp_path):
    """What an export recorded before the rule list: the options resolved (head, keep_8bit), no rules."""
    reference, quantization = recorded
    old = {k: v for k, v in quantization.items() if k not in ("rules", "vision_rules")}
    old |= {"head": "8da8w", "keep_8bit": [r"\.attention\.wv$"]}
    rebuilt = _formats(quantized_model(tmp_path, _manifest(quantization), reference))
    assert _formats(quantized_model(tmp_path, _manifest(old), reference)) == rebuilt


def _decoder_of(name: str):
    """`name`'s decoder without weights (its shapes and config are what the rule reads)."""
    from genai_pipeline.models.decoder import Decoder

    with torch.device("meta"):
        return Decoder(get_spec(name).config, max_seq_len=64)


def test_a_tied_tables_first_rows_take_8_bits_as_many_as_a_share_of_the_bytes_read_allows():
    smollm2, reference = _decoder_of("smollm2-135m"), _decoder_of("reference")  # tied: 49152 and 4096 rows
    default = QuantOptions(recipe="8da4w")
    rows = table_8bit_rows(default, smollm2, "8da4w")
    recipes = linear_recipes(smollm2, default)
    read = sum(linear_bytes(*smollm2.get_submodule(n).weight.shape, r, 32) for n, r in recipes.items())
    per_row = linear_bytes(1, 576, "8da8w", 32) - linear_bytes(1, 576, "8da4w", 32)  # int8 + scale - int4 + scales
    assert rows % 1024 == 0 and rows * per_row <= TABLE_8BIT_SHARE * read < (rows + 1024) * per_row
    assert 8192 <= rows < smollm2.config.vocab_size
    # a small model's table is most of its bytes: 4 % of them buys no whole 1024 rows of the reference's
    assert table_8bit_rows(default, reference, "8da4w") == 0
    assert table_8bit_rows(dataclasses.replace(default, table_8bit_rows=1000), reference, "8da4w") == 1000
    for other in (
        dataclasses.replace(default, embedding="8w"),
        dataclasses.replace(default, table_8bit_rows=0),
        dataclasses.replace(default, size_budget=90.0),
    ):
        assert table_8bit_rows(other, smollm2, "8da4w") == 0
    assert table_8bit_rows(default, smollm2, "8da8w") == 0  # an 8-bit head: no 4-bit table to split
    assert "table13312rows=8w" in describe(dataclasses.replace(default, table_8bit_rows=13312))


def test_a_decoder_whose_inputs_are_rotated_gives_the_table_a_smaller_share():
    """Gemma 3 (sandwich norms): the run-time rotations take most of the rows' decode time (0040)."""
    gemma = _decoder_of("gemma3-1b")
    default = QuantOptions(recipe="8da4w")
    read = sum(
        linear_bytes(*gemma.get_submodule(n).weight.shape, r, 32) for n, r in linear_recipes(gemma, default).items()
    )
    dim = gemma.config.dim
    per_row = linear_bytes(1, dim, "8da8w", 32) - linear_bytes(1, dim, "8da4w", 32)
    rotated, unrotated = (
        table_8bit_rows(o, gemma, "8da4w") for o in (default, dataclasses.replace(default, rotate=False))
    )
    assert rotated * per_row <= TABLE_8BIT_SHARE_ROTATED_INPUTS * read < (rotated + 1024) * per_row
    assert unrotated * per_row <= TABLE_8BIT_SHARE * read < (unrotated + 1024) * per_row
    assert 0 < rotated < unrotated


def _gemma3_270m():
    """Gemma 3 270M's shape (a GGUF's, not a registry entry): a 262,144-row table 640 wide, 18 blocks."""
    from genai_pipeline.models.decoder import Decoder

    config = dataclasses.replace(
        get_spec("gemma3-1b").config, dim=640, n_layers=18, hidden_dim=2048, sliding_window_layers=(0,)
    )
    with torch.device("meta"):
        return Decoder(config, max_seq_len=64)


def test_a_tied_table_that_holds_half_the_weights_takes_every_block_linear_to_8_bits():
    """docs/decisions/0047: Gemma 3 270M's blocks at 8 bits, its table at 4 with its first rows at 8,
    and no run-time rotations, which would rotate 8-bit inputs only."""
    default = QuantOptions(recipe="8da4w")
    gemma = for_decoder(default, _gemma3_270m())
    assert (gemma.keep_8bit, gemma.rotate, gemma.smooth) == ((BLOCKS,), False, default.smooth)
    recipes = linear_recipes(_gemma3_270m(), gemma)
    assert {r for n, r in recipes.items() if n.startswith("layers.")} == {"8da8w"} and recipes[HEAD] == "8da4w"
    assert table_8bit_rows(gemma, _gemma3_270m(), "8da4w") > table_8bit_rows(default, _gemma3_270m(), "8da4w") > 0
    recipe = describe(gemma)
    assert recipe.startswith("8da4w-g32-sq0.5+emb4w+blocks=8da8w") and "more_bits" not in recipe, recipe
    # a residual stream that rotates keeps its rotation: the 4-bit head reads it
    stories = for_decoder(default, _decoder_of("stories15m"))
    assert (stories.keep_8bit, stories.rotate) == ((BLOCKS,), True)
    # every registry text decoder's table holds under a third of its weights: unchanged
    for name in ("smollm2-135m", "gemma3-1b", "qwen2_5-0_5b", "reference"):
        assert for_decoder(default, _decoder_of(name)) == default, name
    # options that name the 8-bit layers, and the other recipes, are kept
    for given in (
        dataclasses.replace(default, keep_8bit=()),
        dataclasses.replace(default, size_budget=220.0),
        dataclasses.replace(default, rules=rules_for(default, 18)),
        QuantOptions(recipe="8da8w"),
    ):
        assert for_decoder(given, _gemma3_270m()) == given


def test_a_head_in_parts_takes_its_recipes_from_the_rule_of_the_whole_head():
    """Rules name the whole head (`output`); split with its table, its first rows take 8 bits and the
    rest the whole head's recipe, and the head's int4 values are cut to the rest's rows."""
    from genai_pipeline.models.decoder import Decoder, DecoderConfig

    config = DecoderConfig(vocab_size=97, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64)
    decoder = Decoder(config, max_seq_len=16)
    decoder.tie_weights()
    values = {"output.weight": (torch.zeros(97, 64, dtype=torch.int8), torch.ones(97, 2)), "other": (None, None)}
    split_tied_table(decoder, 32, values)
    assert values["output.rest.weight"][0].shape == (65, 64) and values["output.rest.weight"][1].shape == (65, 2)
    assert "output.weight" not in values and "other" in values
    default = linear_recipes(decoder, QuantOptions(recipe="8da4w", table_8bit_rows=32))
    assert "output" not in default and (default["output.first"], default["output.rest"]) == ("8da8w", "8da4w")
    overridden = linear_recipes(decoder, QuantOptions(recipe="8da4w", overrides=(("^output$", "8da8w"),)))
    assert overridden["output.rest"] == "8da8w"
    assert decoder.output.first.weight.data_ptr() == decoder.tok_embeddings.first.weight.data_ptr()  # still tied


def test_vision_language_decoders_with_a_tied_table_take_its_rows_as_text_decoders_do():
    """quantize/multimodal.py counts the rows with the text path's rule: Gemma 3 4B's and
    Qwen2.5-VL 3B's tied tables take some by default; untied ones (SmolVLM's) none."""
    default = QuantOptions(recipe="8da4w")
    assert table_8bit_rows(default, _decoder_of("gemma3-4b"), "8da4w") >= 8192
    assert table_8bit_rows(default, _decoder_of("qwen2_5-vl-3b"), "8da4w") >= 8192
    assert table_8bit_rows(default, _decoder_of("smolvlm-256m"), "8da4w") == 0


@pytest.mark.parametrize(
    "options, head, says",
    [
        (QuantOptions(recipe="8da4w", embedding="8w", table_8bit_rows=1000), "8da4w", "applies to a tied token table"),
        (QuantOptions(recipe="8da4w", table_8bit_rows=1000), "8da8w", "applies to a tied token table"),
        (QuantOptions(recipe="8da4w", table_8bit_rows=4096), "8da4w", "is the whole table of 4096 rows"),
    ],
)
def test_table_8bit_rows_where_they_cannot_apply_say_what_to_do(options, head, says):
    with pytest.raises(InputError, match=says):
        table_8bit_rows(options, _decoder_of("reference"), head)


def test_table_8bit_rows_go_with_8da4w_only():
    with pytest.raises(InputError, match="--table-8bit-rows takes a number of rows above 0 with --recipe 8da4w"):
        QuantOptions(recipe="8da8w", table_8bit_rows=1000)
    assert quant_options_from({"recipe": "8da8w"}).table_8bit_rows == 0  # a manifest from before them: none
