"""eval: how far an exported program is from its float model, on the same tokens.

Perplexity of the float model, of the quantized eager model ("qdq") and of the program;
top-1 agreement and KL divergence of the program's next-token distributions against float
(as llama.cpp's --kl-divergence reports them); per-layer SQNR of the quantized eager model's
block outputs against float.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from genai_pipeline.checkpoints.hf import load_decoder, random_decoder
from genai_pipeline.errors import InputError
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.quantize import quant_options_from, quantize_module
from genai_pipeline.registry import get_spec
from genai_pipeline.runtime.session import DecoderSession, EagerSession
from genai_pipeline.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class EvalOptions:
    text: Path
    max_tokens: int = 4096  # tokens of the text to score
    window: int = 0  # tokens per window, the cache starting empty each time; 0: the program's context

    def __post_init__(self):
        if not Path(self.text).is_file():
            raise InputError(f"evaluation text '{self.text}' does not exist")
        if self.max_tokens < 2:
            raise InputError(f"--max-tokens must be at least 2, got {self.max_tokens}")
        if self.window < 0 or self.window == 1:
            raise InputError(f"--window must be 0 (the program's context) or at least 2, got {self.window}")


def float_model(manifest: dict) -> Decoder:
    """The float model an export started from, rebuilt from its manifest."""
    spec = get_spec(manifest["model"])
    if manifest["weights"] == "random":
        from genai_pipeline.models.decoder import DecoderConfig, RopeScaling

        config = dict(manifest["config"])
        if config.get("rope_scaling"):
            config["rope_scaling"] = RopeScaling(**config["rope_scaling"])
        return random_decoder(DecoderConfig(**config), manifest["max_seq_len"], manifest.get("seed", 0))
    return load_decoder(spec, Path(manifest["weights"]), manifest["max_seq_len"])


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (reference - approx).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * math.log10(reference.pow(2).sum().item() / noise)


def _block_outputs(model: Decoder, tokens: list[int]) -> list[torch.Tensor]:
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outputs.append(o.detach())) for layer in model.layers]
    with torch.no_grad():
        model(torch.tensor([tokens]), torch.tensor([0]))
    for h in hooks:
        h.remove()
    return outputs


def evaluate(folder: Path, options: EvalOptions, progress: bool = True) -> dict:
    program = DecoderSession(folder)
    manifest = program.manifest
    tokenizer = Tokenizer(Path(folder) / "tokenizer.json")
    tokens = tokenizer.encode(Path(options.text).read_text(encoding="utf-8", errors="replace"))[: options.max_tokens]
    if len(tokens) < 2:
        raise InputError(f"'{options.text}' has fewer than 2 tokens")
    window = min(options.window or program.max_seq_len, program.max_seq_len)

    reference = float_model(manifest)
    quant = quant_options_from(manifest.get("quantization", {}))
    qdq = None
    if not quant.is_float:
        qdq = copy.deepcopy(reference)
        quantize_module(qdq, quant)
    models = {"float": EagerSession(reference), "program": program}
    if qdq is not None:
        models["qdq"] = EagerSession(qdq)

    nll = {name: 0.0 for name in models}
    agree, kl, count = 0, 0.0, 0
    windows = [tokens[i : i + window] for i in range(0, len(tokens) - 1, window)]
    for chunk in tqdm(windows, desc="eval", unit="window", disable=not progress, leave=False):
        if len(chunk) < 2:
            continue
        targets = torch.tensor(chunk[1:])
        logprobs = {}
        for name, model in models.items():
            model.reset()
            logprobs[name] = torch.log_softmax(model.score(chunk)[:-1].float(), dim=-1)
            nll[name] += -logprobs[name].gather(1, targets[:, None]).sum().item()
        p, q = logprobs["float"], logprobs["program"]
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        kl += (p.exp() * (p - q)).sum().item()
        count += len(targets)

    result = {
        "tokens": count,
        "window": window,
        "recipe": manifest.get("recipe", "fp32"),
        "perplexity": {
            "float": math.exp(nll["float"] / count),
            "qdq": math.exp(nll["qdq"] / count) if qdq is not None else None,
            "program": math.exp(nll["program"] / count),
        },
        "top1_agreement": agree / count,
        "kl_divergence": kl / count,
    }
    if qdq is not None:
        sample = windows[0]
        result["layer_sqnr_db"] = {
            f"layers.{i}": round(sqnr_db(a, b), 2)
            for i, (a, b) in enumerate(zip(_block_outputs(reference, sample), _block_outputs(qdq, sample)))
        }
    return result
