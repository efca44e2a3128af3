"""A prompt's media placeholders (`<image>`, `<audio>`) replaced by each attachment's text, for
image_processing.py and audio_processing.py alike."""

from __future__ import annotations

from genai_pipeline.errors import InputError


def expand_placeholders(prompt: str, texts: list[str], placeholder: str, given: str, flag: str, first: str) -> str:
    """Each `placeholder` of the prompt replaced by the next of `texts`; with none in the prompt,
    the texts go first. More or fewer placeholders than texts is an error naming `flag`
    (`given`: what was passed, e.g. "image(s)"; `first`: what goes first, e.g. "the images")."""
    placeholders = prompt.count(placeholder)
    if placeholders == 0:
        return "".join(texts) + prompt
    if placeholders != len(texts):
        raise InputError(
            f"the prompt has {placeholders} {placeholder} placeholder(s) but {len(texts)} {given} were given; "
            f"pass one {flag} per {placeholder}, or none in the prompt to put {first} first"
        )
    pieces = prompt.split(placeholder)
    return pieces[0] + "".join(text + rest for text, rest in zip(texts, pieces[1:]))
