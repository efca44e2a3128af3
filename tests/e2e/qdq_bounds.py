"""The bounds of a real model's default recipes, scored on their QDQ models as the export's quantize
stage builds them (calibrated), not lowered: a program computes its QDQ model within its kernels'
rounding (tests/e2e/test_tied_embedding.py, test_rotated_inputs.py, tests/quantize), and lowering a
real model's blocks costs minutes more."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch

WINDOW = 512


@dataclass(frozen=True)
class Score:
    """A quantized model against the float one on one text: perplexity change, top-1 agreement."""

    change: float
    top1: float


@dataclass(frozen=True)
class Reference:
    """The float model of a GGUF and what it gives on each text: {text's name: ids}, and the summed
    negative log-likelihood and each scored position's top token."""

    prepared: object  # artifacts.PreparedModel
    ids: dict[str, list[int]]
    scored: dict[str, tuple[float, torch.Tensor]]


def reference(gguf: Path, texts: tuple[Path, ...], tokens: int) -> Reference:
    """The float model of `gguf` scored on the first `tokens` ids of each of `texts` (all of a shorter one)."""
    from genai_pipeline.checkpoints import infer_checkpoint_spec
    from genai_pipeline.options import PrepareOptions
    from genai_pipeline.prepare import prepare
    from genai_pipeline.tokenizer import Tokenizer

    spec, _ = infer_checkpoint_spec(gguf)
    prepared = prepare(spec, PrepareOptions(mode="kv", checkpoint=gguf, max_seq_len=WINDOW))
    tokenizer = Tokenizer.from_folder(prepared.tokenizer_file.parent, bos_id=spec.bos_id)
    ids = {text.name: tokenizer.encode(text.read_text())[:tokens] for text in texts}
    return Reference(prepared, ids, {name: _scored(prepared, text) for name, text in ids.items()})


def scores(reference: Reference, recipe: str) -> tuple[dict[str, Score], str]:
    """`recipe`'s QDQ model with its defaults, made from a copy of the reference's float model, against
    it: ({text's name: Score}, the recipe string it describes itself by)."""
    from genai_pipeline.options import QuantOptions
    from genai_pipeline.quantize import quantize
    from genai_pipeline.targets import get_target

    quantized = quantize(copy.deepcopy(reference.prepared), QuantOptions(recipe=recipe), get_target("xnnpack"))
    result = {}
    for name, text in reference.ids.items():
        (float_nll, float_top), (nll, top) = reference.scored[name], _scored(quantized, text)
        assert nll != float_nll  # a quantized model, not the float one scored twice
        result[name] = Score(math.exp((nll - float_nll) / len(top)) - 1, (top == float_top).double().mean().item())
    return result, quantized.recipe


@torch.no_grad()
def _scored(prepared, ids: list[int]) -> tuple[float, torch.Tensor]:
    """The summed negative log-likelihood of `ids`, in windows of WINDOW, and each scored position's top token."""
    from genai_pipeline.names import ArtifactKey
    from genai_pipeline.runtime.session import EagerSession

    session, total, top = EagerSession(prepared.artifacts[ArtifactKey.TEXT_DECODER].module, WINDOW), 0.0, []
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start : start + WINDOW]
        session.reset()
        logprobs = torch.log_softmax(session.score(window)[:-1].float(), dim=-1)
        total -= logprobs.gather(1, torch.tensor(window[1:])[:, None]).sum().item()
        top.append(logprobs.argmax(-1))
    return total, torch.cat(top)
