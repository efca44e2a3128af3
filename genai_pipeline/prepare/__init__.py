"""prepare: a registry entry (+ optional local checkpoint) -> the graphs of each artifact.

A text entry is prepared by text.py, a vision-language entry by multimodal.py, a speech-language
entry by speech.py (on multimodal.py's text graphs); they build on common.py (and text.py on
cache_io.py), and text.py imports neither of the others, nor they it."""

from __future__ import annotations

from genai_pipeline.artifacts import PreparedModel
from genai_pipeline.errors import InputError
from genai_pipeline.options import PrepareOptions
from genai_pipeline.prepare.common import check_kv_cache_fits
from genai_pipeline.prepare.multimodal import prepare_multimodal
from genai_pipeline.prepare.speech import prepare_speech
from genai_pipeline.prepare.text import prepare_text
from genai_pipeline.registry import ModelSpec


def prepare(spec: ModelSpec, options: PrepareOptions, lazy: bool = False) -> PreparedModel:
    """`lazy`: a text decoder's weights are left in a Hugging Face checkpoint's files, for quantize
    to load a block at a time (PreparedModel.loader); else the model comes loaded."""
    check_kv_cache_fits(spec.config, options.max_seq_len)
    if spec.audio is not None:  # a speech-language model: one program of three components
        if options.cache_io:
            raise InputError(
                f"{spec.name} is a speech model: the cache-I/O form (--cache-io, --target qnn) is built for text decoders only so far"
            )
        return prepare_speech(spec, options)
    if spec.vision is not None:  # a vision-language model: its own module (components, one program)
        if options.cache_io:
            raise InputError(
                f"{spec.name} is a vision-language model: the cache-I/O form (--cache-io, --target qnn) is built for text decoders only so far"
            )
        return prepare_multimodal(spec, options)
    if options.split:
        raise InputError(
            f"--split applies to vision-language models only; {spec.name} is a text-only model (its export is one program already)"
        )
    return prepare_text(spec, options, lazy)
