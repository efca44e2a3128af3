"""quantize, calibration text and the per-layer statistics measured on it: gptq's and smoothing's
samples, a size budget's held-out tokens, each linear's input statistics."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from genai_pipeline.artifacts import PreparedModel
from genai_pipeline.chat_template import read_chat_template
from genai_pipeline.errors import InputError
from genai_pipeline.options import CalibrationOptions, QuantOptions
from genai_pipeline.quantize.recipes import head_recipe

log = logging.getLogger(__name__)


# gptq's calibration text when no --calib is given: English prose that ships with the repository
# (Python's documentation, the reference model's training split; disjoint from heldout.txt)
DEFAULT_GPTQ_TEXT = Path(__file__).resolve().parents[2] / "assets" / "reference" / "sample.txt"


GPTQ_TOKENS = 4096  # calibration tokens for gptq (docs/decisions/0011)
SENSITIVITY_TOKENS = 2048  # a size budget's held-out calibration tokens, the gains are measured on (size_budget.py)


@torch.no_grad()
def observe_inputs(
    module: nn.Module,
    names: set[str],
    samples: list[list[int]],
    window: int,
    record: Callable[[str, torch.Tensor], None],
) -> None:
    """Run `samples` (token lists) through `module` from position 0 in windows, calling
    record(name, x) with each named layer's input as float rows, [tokens, in_features]."""
    with inputs_recorded(module, names, record):
        for sample in samples:
            for i in range(0, len(sample), window):
                module(torch.tensor([sample[i : i + window]]), torch.tensor([0]))


@contextmanager
def inputs_recorded(module: nn.Module, names: set[str], record: Callable[[str, torch.Tensor], None], prefix: str = ""):
    """While open, every forward of a layer of `module` named in `names` (as `prefix` + its name
    in `module`) calls record(name, its input as float rows [tokens, in_features])."""

    def hook(name):
        return lambda _, inputs, __: record(name, inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float())

    handles = [m.register_forward_hook(hook(prefix + n)) for n, m in module.named_modules() if prefix + n in names]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def gptq_samples(prepared: PreparedModel, options: QuantOptions) -> list[list[int]]:
    """gptq's (and smoothing's) calibration tokens: --calib's samples, else the first GPTQ_TOKENS of
    DEFAULT_GPTQ_TEXT; with a size budget, without the tokens held out for it (held_out_tokens)."""
    return _calibration_split(prepared, options)[0]


def held_out_tokens(prepared: PreparedModel, options: QuantOptions) -> list[int]:
    """A size budget's measuring text (size_budget.SENSITIVITY_TOKENS): DEFAULT_GPTQ_TEXT's tokens
    after gptq's, or the last tokens of --calib's samples, which gptq then does not fit."""
    return _calibration_split(prepared, options)[1]


def _calibration_split(prepared: PreparedModel, options: QuantOptions) -> tuple[list[list[int]], list[int]]:
    from genai_pipeline.tokenizer import Tokenizer

    checkpoint = prepared.tokenizer_file.parent if prepared.tokenizer_file else None
    if checkpoint is None:
        raise InputError(
            f"--recipe {options.recipe} calibrates on text (GPTQ, SmoothQuant), and the checkpoint has no tokenizer; "
            "pass a checkpoint with one, or --no-calibration"
        )
    tokenizer = Tokenizer.from_folder(checkpoint, bos_id=prepared.spec.bos_id)
    if options.calibration.datasets:
        from genai_pipeline.data.calibration import calibration_tokens

        samples = calibration_tokens(
            options.calibration,
            tokenizer,
            vocab_size=prepared.config.vocab_size,
            chat_template=read_chat_template(checkpoint),
            seed=prepared.options.seed,
        )
        if options.size_budget is None:
            return samples, []
        held, fit = [], [list(sample) for sample in samples]
        while fit and len(held) < SENSITIVITY_TOKENS:  # from the end, splitting the last sample it needs
            take = min(SENSITIVITY_TOKENS - len(held), len(fit[-1]))
            held = fit[-1][len(fit[-1]) - take :] + held
            fit[-1] = fit[-1][: len(fit[-1]) - take]
            if not fit[-1]:
                fit.pop()
        if sum(map(len, fit)) < SENSITIVITY_TOKENS:
            raise InputError(
                f"--size-budget measures layers on {SENSITIVITY_TOKENS} calibration tokens that gptq does not fit: "
                f"give --calib data of at least {2 * SENSITIVITY_TOKENS} tokens, or no --calib"
            )
        return fit, held
    ids = tokenizer.encode(DEFAULT_GPTQ_TEXT.read_text(encoding="utf-8"))
    return [ids[:GPTQ_TOKENS]], ids[GPTQ_TOKENS : GPTQ_TOKENS + SENSITIVITY_TOKENS]


@torch.no_grad()
def input_absmax(module: nn.Module, samples: list[list[int]], window: int) -> dict[str, torch.Tensor]:
    """Per input channel, the largest magnitude each linear layer's input reaches over `samples`."""
    return input_statistics(module, samples, window)[0]


@torch.no_grad()
def input_statistics(
    module: nn.Module, samples: list[list[int]], window: int, hessian_names: set[str] = frozenset()
) -> tuple[dict, dict]:
    """One pass over `samples` (observe_inputs) for both calibrations: per linear, each input
    channel's largest magnitude (smoothing's); for the linears in `hessian_names`, X^T X of their
    inputs (GPTQ's)."""
    statistics = InputStatistics(hessian_names)
    linears = {n for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    observe_inputs(module, linears, samples, window, statistics.record)
    return statistics.absmax, statistics.hessians


class InputStatistics:
    """What input_statistics measures, accumulated one recorded input at a time."""

    def __init__(self, hessian_names: set[str] = frozenset()):
        self.absmax, self.hessians, self.hessian_names = {}, {}, hessian_names

    def record(self, name: str, x: torch.Tensor) -> None:
        a = x.abs().amax(0)
        self.absmax[name] = torch.maximum(self.absmax[name], a) if name in self.absmax else a
        if name in self.hessian_names:
            xtx = x.T @ x
            if name in self.hessians:
                self.hessians[name].add_(xtx)  # in place: no third n x n while the sum is made
            else:
                self.hessians[name] = xtx


def calibrating(options: QuantOptions) -> tuple[str, ...]:
    """What a dynamic recipe measures on calibration text ("GPTQ", "SmoothQuant", "the size
    budget"), as its options ask for it; a static or float recipe: nothing here."""
    if options.is_static or options.is_float:
        return ()
    int4 = {options.recipe, *(r for _, r in options.overrides), *(r.recipe for r in options.rules or ())}
    wants = {
        "GPTQ": options.weight_rule == "gptq" and "8da4w" in int4,
        "SmoothQuant": options.smooth is not None,
        "the size budget": options.size_budget is not None,
    }
    return tuple(name for name, on in wants.items() if on)


def calibration_free(options: QuantOptions) -> QuantOptions:
    """`options` without what reads calibration text (`--no-calibration`; a model without a
    tokenizer): 4-bit weights by the least-squares scale search (mse) instead of GPTQ, no
    SmoothQuant. The LM head keeps the recipe the calibrated options give it, so that the
    program holds the same layers at the same widths (its size and speed are the full recipe's)."""
    if options.is_static or options.is_float:
        raise InputError(
            f"--no-calibration goes with the dynamic recipes (8da4w, 8da8w); --recipe {options.recipe} "
            + ("calibrates by definition" if options.is_static else "quantizes nothing")
        )
    if options.calibration.datasets or options.size_budget is not None:
        flag = "--calib" if options.calibration.datasets else "--size-budget"
        raise InputError(f"{flag} measures on calibration text, and --no-calibration reads none: drop one of them")
    free = dataclasses.replace(options, weight_rule="mse" if options.weight_rule == "gptq" else options.weight_rule)
    free = dataclasses.replace(free, smooth=None)
    head = head_recipe(options) or options.recipe
    if (head_recipe(free) or free.recipe) != head:
        free = dataclasses.replace(free, head=head)
    return free


def with_default_data(calibration: CalibrationOptions) -> CalibrationOptions:
    """No --calib given: random tokens (calibrating on them warns that accuracy will suffer)."""
    return calibration if calibration.datasets else dataclasses.replace(calibration, datasets=("random",))
