"""Every user-facing option, as typed frozen dataclasses that validate themselves: what the CLI
maps its flags into (and reads its defaults from) and what the Python API takes.

Imports nothing but the standard library, `errors`, `names` and `layer_rules` (a recipe's rules),
so that `genai --help` and `import genai_pipeline` need no torch.

    PrepareOptions       genai export: graphs, modes, lengths, the checkpoint (prepare/)
    QuantOptions         genai export: the recipe, its knobs and its rules (quantize/), with
    CalibrationOptions   its calibration data (`--calib NAME:ARG` -> DatasetSpec; data/)
    QnnOptions           genai export --target qnn (targets/qnn.py)
    SamplingOptions      genai run (runtime/generate.py)
    EvalOptions          genai eval --text (evaluate/text.py)
    ImageEvalOptions     genai eval --images (evaluate/images.py)
    BenchOptions         genai bench (bench/text.py)
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from genai_pipeline.errors import DataError, InputError
from genai_pipeline.layer_rules import Rule, read_rules
from genai_pipeline.names import Mode

DEFAULT_MODEL = "reference"  # the registry entry `genai export` exports when given neither a model nor a checkpoint


# ---- prepare ----

LONG_PREFILL_CHUNKS = 4  # the default `prefill` length, in `prefill_chunk` lengths


@dataclass(frozen=True)
class PrepareOptions:
    mode: Mode = Mode.HYBRID
    max_seq_len: int = 512  # KV cache length: prompt + generated tokens
    prefill_len: int = 32  # tokens per `prefill_chunk` call in hybrid mode
    # Hybrid: the most tokens per `prefill` call, a prefill method of any length up to it,
    # which prompts go through in chunks (no padding; fewer, larger calls: each reads every weight once;
    # longer chunks prefill slower per token at 135M: docs/decisions/0022);
    # None: LONG_PREFILL_CHUNKS x prefill_len where the cache holds it; 0: none
    long_prefill_len: int | None = None
    # Tokens per `verify` call, an extra method returning the logits after EVERY token ([1, N,
    # vocab]) for lookahead decoding (the last accepted token + up to N - 1 drafts), of any length
    # up to N; 0: none.
    verify_len: int = 0
    checkpoint: Path | None = (
        None  # local checkpoint folder (the entry's format); None: the entry's shipped weights, else random
    )
    seed: int = 0  # for random weights
    # A vision-language model as one program per component (vision_encoder.pte, token_embedding.pte,
    # text_decoder.pte: the layout NPU backends use) instead of one program with three methods.
    split: bool = False
    # The decoder's cache-I/O form (QNN's; --cache-io, always on for --target qnn): the KV cache,
    # positions and attention mask are graph inputs/outputs (models/cache_io.py) instead of a
    # cache inside the program updated by ExecuTorch's custom ops at a data-dependent position.
    cache_io: bool = False

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.cache_io and self.mode is Mode.DYNAMIC:
            raise InputError(
                "the cache-I/O form (--cache-io, --target qnn) has static shapes: use --mode hybrid or kv, not dynamic"
            )
        if self.cache_io and self.verify_len:
            raise InputError("--verify-len is not available in the cache-I/O form (--cache-io, --target qnn) yet")
        if self.max_seq_len < 2:
            raise InputError(f"--max-seq-len must be at least 2, got {self.max_seq_len}")
        if not 1 <= self.prefill_len <= self.max_seq_len:
            raise InputError(
                f"--prefill-len must be between 1 and --max-seq-len ({self.max_seq_len}), got {self.prefill_len}"
            )
        if self.verify_len and not 2 <= self.verify_len <= self.max_seq_len:
            raise InputError(
                f"--verify-len must be 0 (no verify method) or between 2 and --max-seq-len ({self.max_seq_len}), got {self.verify_len}"
            )
        if self.long_prefill_len and not (
            self._with_long and self.prefill_len < self.long_prefill_len <= self.max_seq_len
        ):
            raise InputError(
                f"--long-prefill-len takes 0 (none) or, in --mode hybrid without --cache-io, a length between --prefill-len "
                f"({self.prefill_len}) and --max-seq-len ({self.max_seq_len}); got {self.long_prefill_len}"
            )

    @property
    def _with_long(self) -> bool:
        return self.mode is Mode.HYBRID and not self.cache_io

    @property
    def long_prefill(self) -> int:
        """The `prefill` length in effect (long_prefill_len, or its default); 0: no such method."""
        if self.long_prefill_len is not None:
            return self.long_prefill_len
        long = LONG_PREFILL_CHUNKS * self.prefill_len
        return long if self._with_long and long <= self.max_seq_len else 0


# ---- calibration data ----

# kind -> what its ARG is; `random` takes none.
DATASET_KINDS: dict[str, str | None] = {
    "random": None,
    "text": "a UTF-8 text file",
    "messages": "a JSON file of chat samples",
    "hf-chat": "a folder saved by Hugging Face `datasets` (parquet, arrow or jsonl files)",
    "lm-eval": "a task's data cached as JSON lines",
}


def _known() -> str:
    return ", ".join(f"{kind}:ARG" if arg else kind for kind, arg in DATASET_KINDS.items())


@dataclass(frozen=True)
class DatasetSpec:
    kind: str
    arg: str | None = None

    def __post_init__(self):
        if self.kind not in DATASET_KINDS:
            raise DataError(f"unknown calibration dataset '{self.kind}'; known: {_known()}")
        wants = DATASET_KINDS[self.kind]
        if wants is None and self.arg:
            raise DataError(
                f"'{self.kind}' takes no argument (got '{self.arg}'); set the sample count with --calib-limit"
            )
        if wants is not None and not self.arg:
            raise DataError(f"'{self.kind}' needs {wants}: --calib {self.kind}:PATH")

    @property
    def path(self) -> Path:
        if self.arg is None:
            raise ValueError(f"'{self.kind}' has no path")
        return Path(self.arg)

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


def parse_dataset(text: str) -> DatasetSpec:
    """`NAME:ARG` (as given to `--calib`) -> DatasetSpec; the ARG is everything after the first ':'."""
    kind, _, arg = text.strip().partition(":")
    return DatasetSpec(kind, arg or None)


@dataclass(frozen=True)
class CalibrationOptions:
    datasets: tuple[DatasetSpec, ...] = ()  # --calib, in order; their samples are concatenated
    limit: int | None = None  # --calib-limit: samples in all (the first ones); `random` makes this many, else 8
    seq_len: int = 128  # --calib-seq-len: tokens per sample; longer samples are truncated

    def __post_init__(self):
        datasets = (self.datasets,) if isinstance(self.datasets, (str, DatasetSpec)) else self.datasets
        specs = tuple(parse_dataset(d) if isinstance(d, str) else d for d in datasets)
        if not all(isinstance(d, DatasetSpec) for d in specs):
            raise TypeError(f"datasets must be DatasetSpec or 'NAME:ARG' strings, got {self.datasets!r}")
        object.__setattr__(self, "datasets", specs)
        if self.limit is not None and self.limit < 1:
            raise InputError(f"--calib-limit must be at least 1, got {self.limit}")
        if self.seq_len < 1:
            raise InputError(f"--calib-seq-len must be at least 1, got {self.seq_len}")


# ---- quantize ----

LINEAR_RECIPES = ("fp32", "8da4w", "8da8w")  # torchao, in eager mode
STATIC_RECIPES = ("8a8w", "16a8w", "16a4w", "16a4w_block")  # PT2E, calibrated
EMBEDDING_RECIPES = ("4w", "8w")
AUTO_EMBEDDING = {"8da4w": "4w", "8da8w": "8w"}  # --embedding auto, by --recipe
WEIGHT_RULES = ("gptq", "mse", "q4_0", "torchao")  # how 4-bit weights are chosen (measured: docs/decisions/0011)
# SmoothQuant's migration strength for the dynamic recipes' per-token int8 activations (docs/decisions/0016, 0017)
SMOOTH_ALPHA = 0.5


@dataclass(frozen=True)
class QuantOptions:
    recipe: str = "fp32"
    group_size: int = 32  # int4 weights: values per scale
    embedding: str | None = "auto"  # 8w, 4w; auto: by recipe; fp32 or None: keep it float
    overrides: tuple[tuple[str, str], ...] = ()  # (regex over linear names, recipe): rules before the recipe's
    block_size: int = 64  # 16a4w_block: values per scale
    weight_rule: str = (
        "gptq"  # 4-bit weights: gptq (calibrated), mse (least-squares scales), q4_0 (llama.cpp's, positive), torchao
    )
    head: str | None = "auto"  # the LM head's recipe; auto: the recipe's rule (quantize/recipes.py); None: the recipe
    # regexes of layers at 8da8w under 8da4w; None: the recipe's rule (quantize/recipes.py for_decoder)
    keep_8bit: tuple[str, ...] | None = None
    smooth: float | None = SMOOTH_ALPHA  # dynamic recipes: SmoothQuant's alpha on the calibration text; None: off
    rotate: bool = True  # dynamic recipes: rotate first, the residual stream or the linears' inputs (rotation.py)
    calibration: CalibrationOptions = CalibrationOptions()  # static recipes only
    # A vision-language model's image tower and connector (quantize/multimodal.py); None: not given
    # (the export then records the one AUTO_VISION chose). A text model refuses it.
    vision_recipe: str | None = None
    # 8da4w: the program's size in MB (10^6 bytes); the block linears kept at 8 bits are then measured
    # and chosen (size_budget.py) instead of by the recipe's fixed rules
    size_budget: float | None = None
    # 8da4w with a tied table at 4 bits: its first rows (the lowest ids, a vocabulary's most frequent
    # tokens) at 8 bits for lookup and LM head; None: the recipe's rule (quantize/recipes.py); 0: none
    table_8bit_rows: int | None = None
    promoted: tuple[str, ...] | None = None  # with size_budget: the linears it chose (None: not yet chosen)
    # The whole rule list of the decoder's linears, first match wins; None: built from the options
    # above (quantize/recipes.py: overrides, promotions, the recipe's). An export records the rules
    # it applied, and `genai eval` applies exactly those. vision_rules: the image tower's.
    rules: tuple[Rule, ...] | None = None
    vision_rules: tuple[Rule, ...] | None = None

    def __post_init__(self):
        if self.recipe not in LINEAR_RECIPES + STATIC_RECIPES:
            raise InputError(f"unknown recipe '{self.recipe}'; known: {', '.join(LINEAR_RECIPES + STATIC_RECIPES)}")
        if self.vision_recipe is not None and self.vision_recipe not in LINEAR_RECIPES:
            raise InputError(f"--vision-recipe must be one of {', '.join(LINEAR_RECIPES)}, got '{self.vision_recipe}'")
        for _, recipe in self.overrides:
            if recipe not in LINEAR_RECIPES or self.is_static:
                raise InputError(f"overrides take {', '.join(LINEAR_RECIPES)} with a dynamic --recipe, got '{recipe}'")
        if self.embedding == "auto":
            object.__setattr__(self, "embedding", AUTO_EMBEDDING.get(self.recipe))
        if self.embedding == "fp32":
            object.__setattr__(self, "embedding", None)
        if self.head not in (None, "auto") and (self.head not in LINEAR_RECIPES or self.is_static):
            raise InputError(
                f"the LM head takes {', '.join(LINEAR_RECIPES)} with a dynamic --recipe, got '{self.head}'"
            )
        if self.table_8bit_rows and (self.recipe != "8da4w" or self.table_8bit_rows < 0):
            raise InputError(
                f"--table-8bit-rows takes a number of rows above 0 with --recipe 8da4w, got {self.table_8bit_rows} "
                f"with {self.recipe}"
            )
        if self.size_budget is not None and (self.recipe != "8da4w" or not self.size_budget > 0):
            raise InputError(
                f"--size-budget takes a size in MB above 0 with --recipe 8da4w, got {self.size_budget:g} with {self.recipe}"
            )
        for name in ("promoted", "keep_8bit"):  # e.g. lists from JSON
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "overrides", tuple(tuple(o) for o in self.overrides))
        object.__setattr__(self, "rules", read_rules(self.rules))
        object.__setattr__(self, "vision_rules", read_rules(self.vision_rules))
        for rule in (self.rules or ()) + (self.vision_rules or ()):
            if rule.recipe not in LINEAR_RECIPES or self.is_static:
                raise InputError(f"rules take {', '.join(LINEAR_RECIPES)} with a dynamic --recipe, got '{rule.recipe}'")
        if self.vision_rules is not None and self.vision_recipe is None:
            raise InputError("vision_rules quantize an image tower: they go with a vision recipe")
        if self.is_static or self.recipe == "fp32":
            object.__setattr__(self, "smooth", None)
            object.__setattr__(self, "rotate", False)
        if self.smooth is not None and not 0 < self.smooth < 1:
            raise InputError(f"the smoothing strength must be between 0 and 1, got {self.smooth}")
        if self.weight_rule not in WEIGHT_RULES:
            raise InputError(f"unknown weight rule '{self.weight_rule}'; known: {', '.join(WEIGHT_RULES)}")
        if self.is_static and self.embedding:
            raise InputError(
                "--embedding goes with the dynamic recipes (8da4w, 8da8w); static recipes quantize what their quantizer annotates"
            )
        if self.embedding is not None and self.embedding not in EMBEDDING_RECIPES:
            raise InputError(
                f"--embedding must be auto, fp32 or one of {', '.join(EMBEDDING_RECIPES)}, got '{self.embedding}'"
            )
        if self.group_size < 1 or self.group_size & (self.group_size - 1):
            raise InputError(f"--group-size must be a power of two, got {self.group_size}")
        if self.is_float and self.calibration.datasets:
            raise InputError(
                "--calib calibrates a quantized recipe, and --recipe fp32 quantizes nothing: drop --calib, "
                f"or pick a recipe ({', '.join(r for r in LINEAR_RECIPES + STATIC_RECIPES if r != 'fp32')})"
            )
        for pattern, _ in self.overrides:
            try:
                re.compile(pattern)
            except re.error as e:
                raise InputError(f"override pattern '{pattern}' is not a valid regex: {e}") from None

    @property
    def is_static(self) -> bool:
        return self.recipe in STATIC_RECIPES

    @property
    def is_float(self) -> bool:
        return (
            self.recipe == "fp32"
            and self.embedding is None
            and all(r == "fp32" for _, r in self.overrides)
            and all(r.recipe == "fp32" for r in (self.rules or ()) + (self.vision_rules or ()))
            and self.vision_recipe in (None, "fp32")
        )


def quant_options_from(data: dict) -> QuantOptions:
    """The inverse of the manifest's `quantization` entry."""
    if not data:
        return QuantOptions()
    calibration = data.get("calibration") or {}
    calibration = CalibrationOptions(
        datasets=tuple(DatasetSpec(**d) for d in calibration.get("datasets", ())),
        limit=calibration.get("limit"),
        seq_len=calibration.get("seq_len", CalibrationOptions().seq_len),
    )
    overrides = tuple(tuple(o) for o in data.get("overrides", ()))
    # exports made before rotation (0.x) record no `rotate`: they were not rotated; nor those before
    # the table's 8-bit rows a `table_8bit_rows`: they had none
    return QuantOptions(
        **{"rotate": False, "table_8bit_rows": 0, **data, "overrides": overrides, "calibration": calibration}
    )


def parse_override(text: str) -> tuple[str, str]:
    pattern, sep, recipe = text.rpartition("=")
    if not sep or not pattern:
        raise InputError(f"--quant-override takes REGEX=RECIPE (e.g. 'output=8da8w'), got '{text}'")
    return pattern, recipe


# ---- targets ----


@dataclass(frozen=True)
class QnnOptions:
    soc: str = "SM8650"  # --soc, any name of ExecuTorch's QcomChipset table, case-insensitive
    weight_sharing: bool = True  # multi-graph programs: one context binary, weights shared (--no-weight-sharing)
    x86_emulator: bool = False  # --qnn-x86-emulator: HTP emulated on x86, which shares neither weights nor buffers
    options: tuple[str, ...] = ()  # --qnn-option [METHOD:]KEY=VALUE, HTP backend options


# ---- run, eval, bench ----


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # NaN too
            raise InputError(f"--temperature must be a number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p must be in (0, 1], got {self.top_p}")


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


@dataclass(frozen=True)
class ImageEvalOptions:
    images: Path  # a jsonl of {"image", "prompt", "answer"}
    limit: int = 0  # the first N questions; 0: all

    def __post_init__(self):
        if not Path(self.images).is_file():
            raise InputError(f"image questions '{self.images}' do not exist")
        if self.limit < 0:
            raise InputError(f"--limit must be >= 0, got {self.limit}")


@dataclass(frozen=True)
class BenchOptions:
    prompt_len: int = 128
    gen_len: int = 128
    repeats: int = 5
    threads: int = 0  # 0: the runtime's default (one per core)
    lookahead: int = 0  # > 0: also measure lookahead decoding with drafts of up to this many tokens
    prompt_file: Path | None = None  # the prompt's text instead of prompt_len random ids
    chat: bool = False  # prompt_file is a user message, rendered through the chat template

    def __post_init__(self):
        for name in ("prompt_len", "gen_len", "repeats"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.threads <= os.cpu_count():
            raise InputError(
                f"--threads must be between 0 (one per core) and {os.cpu_count()}, the cores of this machine; got {self.threads}"
            )
        if self.lookahead < 0:
            raise InputError(f"--lookahead must be >= 0, got {self.lookahead}")
        if self.chat and self.prompt_file is None:
            raise InputError("--chat needs --prompt-file (the user message)")
