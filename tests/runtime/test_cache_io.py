"""The decoder's cache-I/O form (QNN's) driven by runtime/cache_io.py's session: the same logits as
the ordinary decoder, in eager and as a program, with the KV cache held by the driver."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import TINY_MAX_SEQ, TINY_PREFILL

from genai_pipeline.checkpoints.hf import random_decoder
from genai_pipeline.models.cache_io import CacheIOContract, eager_runner
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.names import GraphName
from genai_pipeline.prepare.cache_io import CacheIOGraph
from genai_pipeline.runtime.cache_io import CacheIOSession
from genai_pipeline.runtime.open import open_session
from genai_pipeline.runtime.session import EagerSession

PROMPT = [
    5,
    17,
    42,
    7,
    99,
    3,
    250,
    11,
    64,
    8,
    120,
    33,
    2,
    77,
    150,
    9,
    31,
    200,
    45,
]  # 19: chunks of 8, 8 and a left-padded 3


def _eager_cache_io(decoder, prefill_len: int) -> CacheIOSession:
    decoder.use_cache_io()
    graph = CacheIOGraph(decoder)
    contract = CacheIOContract.of(decoder, {"prefill_chunk": prefill_len, "decode_token": 1})
    return CacheIOSession(
        contract, eager_runner({GraphName.PREFILL_CHUNK: graph, GraphName.DECODE_TOKEN: graph}, decoder.config.n_layers)
    )


def _max_diff_over_a_conversation(session, reference, steps: int = 6) -> float:
    """A prompt, greedy decode steps, then a second prompt from the cursor (a chat turn)."""
    worst = 0.0
    got, want = session.prefill(PROMPT), reference.prefill(PROMPT)
    for _ in range(steps):
        worst = max(worst, (got - want).abs().max().item())
        token = int(want.argmax())
        got, want = session.step(token), reference.step(token)
    got, want = session.prefill(PROMPT[:11]), reference.prefill(PROMPT[:11])
    return max(worst, (got - want).abs().max().item())


GEMMA_LIKE = DecoderConfig(  # sliding-window layers with their own RoPE base, qk norm, sandwich norms, softcap
    vocab_size=256,
    dim=64,
    n_layers=3,
    n_heads=4,
    n_kv_heads=1,
    hidden_dim=96,
    head_dim=16,
    qk_norm=True,
    sandwich_norms=True,
    norm_unit_offset=True,
    activation="gelu_tanh",
    scale_embeddings=True,
    sliding_window=5,
    sliding_window_layers=(0, 2),
    rope_theta=1e6,
    rope_local_theta=1e4,
    attention_scale=0.2,
    final_logit_softcap=30.0,
)


# OLMo 2's norms (after attention and MLP only, q/k over the whole projection), Granite's
# multipliers, SmolLM3's layer without RoPE, Mistral's window in every layer
NEW_FAMILIES_LIKE = dataclasses.replace(
    GEMMA_LIKE,
    norm_unit_offset=False,
    pre_norms=False,
    qk_norm_across_heads=True,
    activation="silu",
    scale_embeddings=False,
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    logit_divisor=2.5,
    final_logit_softcap=None,
    rope_local_theta=None,
    sliding_window_layers=(0, 1, 2),
    nope_layers=(1,),
)


def test_eager_cache_io_form_of_the_new_families_switches():
    session = _eager_cache_io(random_decoder(NEW_FAMILIES_LIKE, 40, seed=1), 8)
    assert _max_diff_over_a_conversation(session, EagerSession(random_decoder(NEW_FAMILIES_LIKE, 40, seed=1))) <= 1e-4


def test_a_convolution_decoder_has_no_cache_io_form():
    from genai_pipeline.errors import InputError
    from genai_pipeline.options import PrepareOptions
    from genai_pipeline.prepare.cache_io import cache_io_graphs

    decoder = random_decoder(dataclasses.replace(NEW_FAMILIES_LIKE, conv_layers=(1,)), 40)
    with pytest.raises(InputError, match="without --cache-io"):
        cache_io_graphs(decoder, PrepareOptions(cache_io=True, max_seq_len=40, prefill_len=8))


def test_eager_cache_io_form_gives_the_ordinary_decoders_logits(tiny_eager):
    """Llama 3 RoPE scaling, GQA; prefill chunks (one left-padded), decode steps, a second turn."""
    session, reference = _eager_cache_io(tiny_eager(), TINY_PREFILL), EagerSession(tiny_eager())
    assert _max_diff_over_a_conversation(session, reference) <= 1e-4


def test_eager_cache_io_form_with_sliding_window_layers():
    torch.manual_seed(0)
    session = _eager_cache_io(random_decoder(GEMMA_LIKE, 40, seed=1), 8)
    assert session.contract.sliding_window == 5  # a window_mask input as well
    assert _max_diff_over_a_conversation(session, EagerSession(random_decoder(GEMMA_LIKE, 40, seed=1))) <= 1e-4


@pytest.mark.parametrize("target", ["portable"])
def test_cache_io_program_run_by_the_driver_gives_the_eager_logits(export_tiny, tiny_eager, target, capsys):
    """The same graphs lowered without QNN, run by the runtime's driver, as a device runner would."""
    from genai_pipeline.cli import main

    folder = export_tiny("hybrid", target, cache_io=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["decoder_form"] == "cache-io" and manifest["cache_io"]["tokens_per_call"] == {
        "prefill_chunk": TINY_PREFILL,
        "decode_token": 1,
    }
    session = open_session(folder)
    assert isinstance(session, CacheIOSession)
    assert _max_diff_over_a_conversation(session, EagerSession(tiny_eager())) <= 1e-4

    # the program keeps no cache of its own: its inputs are the contract's
    from genai_pipeline.runtime.program import load_program

    program = load_program(folder / "text_decoder.pte")
    meta = program.metadata("decode_token")
    shapes = [tuple(meta.input_tensor_meta(i).sizes()) for i in range(meta.num_inputs())]
    assert shapes[:3] == [(1, 1), (1, 1), (1, 1, 1, TINY_MAX_SEQ + 1)]
    assert shapes[3:] == [(1, 2, TINY_MAX_SEQ, 16)] * 4  # k_past, v_past of 2 layers

    # `genai run` drives it through the same session: greedy text equals the eager model's
    from genai_pipeline.options import SamplingOptions
    from genai_pipeline.runtime.generate import Sampler, generate

    assert main(["run", str(folder), "--prompt", "The module", "--max-new-tokens", "8", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    from genai_pipeline.tokenizer import Tokenizer

    prompt = Tokenizer.from_folder(folder, bos_id=manifest["bos_id"]).encode("The module")
    eager = generate(EagerSession(tiny_eager()), prompt, 8, Sampler(SamplingOptions()), tuple(manifest["eos_ids"]))
    assert ran["tokens"] == eager.tokens
