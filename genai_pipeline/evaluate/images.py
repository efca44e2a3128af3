"""eval --images: a vision-language program against its float model on image questions.

Each line of the file is `{"image", "prompt", "answer"}` (the image path relative to the file; other
keys, e.g. `kind`, are ignored). The prompt is what `genai run DIR --image IMAGE --prompt PROMPT`
feeds the program (the image expanded as the family's processor does), for both models:

- exact match: greedy decoding, at most the answer's token count + MARGIN new tokens, stopping at an
  end-of-sequence id; the stripped answer text must equal the stripped expected one.
- answer perplexity: the expected answer fed after the prompt (teacher forcing) as ' ' + answer and
  the first end-of-sequence id (what generation emits when it answers right), exp of the mean
  negative log-likelihood over all answers' tokens.

The float model is rebuilt from the export's manifest and checkpoint (as `genai eval --text` does)
and run eagerly on the same prompt ids and the same preprocessed frames.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from genai_pipeline.errors import InputError
from genai_pipeline.export_folder import check_weights
from genai_pipeline.limits import read_input_text
from genai_pipeline.manifest import COMPLETE, Manifest
from genai_pipeline.options import ImageEvalOptions
from genai_pipeline.runtime.generate import generate, greedy_token
from genai_pipeline.runtime.multimodal import EagerMultimodalSession, MultimodalSession, is_multimodal

MARGIN = 4  # new tokens allowed past the expected answer's length


@dataclass(frozen=True)
class Question:
    image: Path
    prompt: str
    answer: str


def read_questions(path: Path, limit: int = 0) -> list[Question]:
    """The file's questions, every line checked (JSON object, three strings, the image exists)."""
    questions = []
    for number, line in enumerate(read_input_text(path, "--images").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not JSON ({e.msg})") from None
        except RecursionError:
            raise InputError(f"{where}: JSON nested too deeply to read") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("image", "prompt", "answer")):
            raise InputError(f'{where}: expected an object with string "image", "prompt" and "answer"')
        image = Path(path).parent / row["image"]
        if not image.is_file():
            raise InputError(f"{where}: image '{image}' does not exist")
        questions.append(Question(image, row["prompt"], row["answer"]))
        if limit and len(questions) == limit:
            break
    if not questions:
        raise InputError(f"'{path}' holds no questions")
    return questions


def _answer_nll(session, prompt: list[int], frames: list[np.ndarray], answer: list[int]) -> float:
    """Negative log-likelihood of `answer` after the prompt (teacher forcing)."""
    session.reset()
    session.frames = list(frames)
    logits = session.prefill(prompt)
    nll = 0.0
    for i, token in enumerate(answer):
        if i:
            logits = session.step(answer[i - 1])
        nll -= torch.log_softmax(logits.float(), dim=-1)[token].item()
    return nll


def _greedy_answer(
    session, prompt: list[int], frames: list[np.ndarray], max_new: int, eos: tuple[int, ...]
) -> list[int]:
    session.reset()
    session.frames = list(frames)
    return generate(session, prompt, max_new, greedy_token, eos).tokens


def evaluate_images(folder: Path, options: ImageEvalOptions, progress: bool = True) -> dict:
    from genai_pipeline.evaluate.text import float_model

    folder = Path(folder)
    manifest = Manifest.read(folder)
    manifest.refuse_speech(folder, "genai eval --images")
    if not is_multimodal(manifest):
        raise InputError(f"'{folder}' holds a text-only model: --images needs a vision-language export (use --text)")
    questions = read_questions(options.images, options.limit)
    if manifest.status != COMPLETE:
        raise InputError(f"'{folder}' has no program (status {manifest.status}): nothing to evaluate")
    check_weights(manifest.checkpoint)  # the float model must be the one the program was made from
    program = MultimodalSession(folder)
    tokenizer = manifest.tokenizer(folder)
    eos = manifest.eos_ids
    if not eos:
        raise InputError(f"'{folder}/manifest.json' names no end-of-sequence id: answers could not end")
    reference = EagerMultimodalSession(float_model(manifest), program.image_token_id)
    models = {"float": reference, "program": program}

    hits = {name: 0 for name in models}
    nll = {name: 0.0 for name in models}
    agree, answer_tokens = 0, 0
    for q in tqdm(questions, desc="eval --images", unit="question", disable=not progress, leave=False):
        prompt = program.encode_prompt(tokenizer, q.prompt, [q.image])  # stages the frames in the program session
        frames = list(program.frames)
        answer = tokenizer.encode(" " + q.answer, add_special_tokens=False) + [eos[0]]
        if len(prompt) + len(answer) > program.max_seq_len:
            raise InputError(
                f"{q.image.name}: the prompt and answer take {len(prompt) + len(answer)} tokens, "
                f"more than the program's context of {program.max_seq_len}"
            )
        max_new = min(len(answer) + MARGIN, program.max_seq_len - len(prompt) + 1)
        answers = {}
        for name, session in models.items():
            nll[name] += _answer_nll(session, prompt, frames, answer)
            answers[name] = tokenizer.decode(_greedy_answer(session, prompt, frames, max_new, eos)).strip()
            hits[name] += answers[name] == q.answer.strip()
        agree += answers["float"] == answers["program"]
        answer_tokens += len(answer)
    n = len(questions)
    return {
        "questions": n,
        "recipe": manifest.recipe,
        "answer_tokens": answer_tokens,
        "exact_match": {name: hits[name] / n for name in models},
        "answer_perplexity": {name: math.exp(nll[name] / answer_tokens) for name in models},
        "answers_agree": agree / n,  # the program's answer text equals the float model's
    }
