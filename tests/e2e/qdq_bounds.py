"""The perplexity bounds of a real model's default recipes, scored on their QDQ models as the
export's quantize stage builds them (calibrated), not lowered: a program computes its QDQ model
within its kernels' rounding (tests/e2e/test_tied_embedding.py, test_rotated_inputs.py,
tests/quantize), and lowering a real model's blocks costs minutes more."""

from __future__ import annotations

import math
from pathlib import Path

import torch

WINDOW = 512
TOKENS = 1024  # of each text: 1022 scored, in windows of WINDOW


def perplexity_changes(gguf: Path, recipe: str, texts: tuple[Path, ...]) -> tuple[dict[str, float], str]:
    """The perplexity change of `recipe`'s QDQ model with its defaults against the float model, on
    the first TOKENS ids of each of `texts`: ({text's name: change}, the recipe string it describes
    itself by)."""
    from genai_pipeline.checkpoints import infer_checkpoint_spec
    from genai_pipeline.names import ArtifactKey
    from genai_pipeline.options import PrepareOptions, QuantOptions
    from genai_pipeline.prepare import prepare
    from genai_pipeline.quantize import quantize
    from genai_pipeline.runtime.session import EagerSession
    from genai_pipeline.targets import get_target
    from genai_pipeline.tokenizer import Tokenizer

    spec, _ = infer_checkpoint_spec(gguf)
    prepared = prepare(spec, PrepareOptions(mode="kv", checkpoint=gguf, max_seq_len=WINDOW))
    tokenizer = Tokenizer.from_folder(prepared.tokenizer_file.parent, bos_id=spec.bos_id)
    ids = {text.name: tokenizer.encode(text.read_text())[:TOKENS] for text in texts}

    @torch.no_grad()
    def nll(model, ids) -> tuple[float, int]:
        session, total, count = EagerSession(model.artifacts[ArtifactKey.TEXT_DECODER].module, WINDOW), 0.0, 0
        for start in range(0, len(ids) - 1, WINDOW):
            window = ids[start : start + WINDOW]
            session.reset()
            logprobs = torch.log_softmax(session.score(window)[:-1].float(), dim=-1)
            total -= logprobs.gather(1, torch.tensor(window[1:])[:, None]).sum().item()
            count += len(window) - 1
        return total, count

    floats = {name: nll(prepared, text) for name, text in ids.items()}
    quantized = quantize(prepared, QuantOptions(recipe=recipe), get_target("xnnpack"))  # in place
    changes = {}
    for name, text in ids.items():
        (float_nll, count), (quantized_nll, _) = floats[name], nll(quantized, text)
        assert count == TOKENS - 2 and quantized_nll != float_nll  # a quantized model, not the float one scored twice
        changes[name] = math.exp((quantized_nll - float_nll) / count) - 1
    return changes, quantized.recipe
