"""serve/engine.py's pieces that need no program: a reply's text ended before a stop string, with
no part of one ever sent; the cache keys that tell two images apart."""

from __future__ import annotations

import numpy as np
from conftest import REFERENCE

from genai_pipeline.image_processing import Frames
from genai_pipeline.serve.engine import StopText, cache_keys
from genai_pipeline.tokenizer import Tokenizer

TOKENIZER = Tokenizer.from_folder(REFERENCE)


def pieces(text: str, stops: tuple[str, ...]) -> tuple[list[str], StopText]:
    """`text` fed token by token until a stop string ends it, as the generation loop feeds it."""
    stream = StopText(TOKENIZER, stops)
    sent = []
    for token in TOKENIZER.encode(text, add_special_tokens=False):
        sent.append(stream.push(token))
        if stream.stopped:
            break
    sent.append(stream.flush())
    return sent, stream


def test_the_text_ends_before_the_first_stop_string_and_none_of_it_is_sent():
    text = "The list object is a mutable sequence. The tuple is not."
    sent, stream = pieces(text, ("sequence", "tuple"))
    assert stream.stopped and stream.text == "The list object is a mutable "
    assert "".join(sent) == stream.text
    assert not any("seq" in piece for piece in sent)


def test_text_that_may_start_a_stop_string_is_held_until_it_does_not():
    sent, stream = pieces("a mutable sequel", ("sequence",))  # tokens: a, " mutable", " se", "que", "l"
    assert not stream.stopped and "".join(sent) == stream.text == "a mutable sequel"
    assert sent == ["a", " mutable", " ", "", "sequel", ""]  # "se", then "seque", waited for the "l"


def test_without_stop_strings_every_piece_goes_at_once():
    text = "The list object is a mutable sequence."
    sent, stream = pieces(text, ())
    assert "".join(sent) == text and sent[-1] == ""


def test_cache_keys_tell_images_apart():
    red, blue = (Frames((np.full((3, 4, 4), v, np.uint8),), 0, 0) for v in (1, 2))
    ids = [7, 9, 9, 8]  # 9: the image token, two per image
    assert cache_keys(ids, (), 9, []) == tuple(ids)
    a, b = cache_keys(ids, (red,), 9, [2]), cache_keys(ids, (blue,), 9, [2])
    assert a[0] == b[0] == 7 and a[3] == b[3] == 8 and a[1] != b[1]
    assert a == cache_keys(ids, (red,), 9, [2])
