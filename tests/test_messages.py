"""The Sample type: text or a chat, and a chat's images taken from its content parts."""

from pathlib import Path

import pytest

from genai_pipeline.data import ContentPart, Message, Sample


def test_a_sample_is_text_or_messages():
    with pytest.raises(ValueError):
        Sample()
    with pytest.raises(ValueError):
        Sample(text="a", messages=(Message("user", "b"),))
    with pytest.raises(ValueError):
        Sample(text="a", images=(Path("x.png"),))
    with pytest.raises(ValueError):
        Sample(messages=())


def test_images_come_from_the_content_parts_in_order():
    a, b = Path("a.png"), Path("b.png")
    content = (ContentPart("image", image=a), ContentPart("text", text="and"), ContentPart("image", image=b))
    sample = Sample(messages=(Message("system", "look"), Message("user", content)))
    assert sample.images == (a, b)
    assert sample.messages[1].text == "and"
    with pytest.raises(ValueError, match="differ"):
        Sample(messages=sample.messages, images=(b, a))


def test_message_and_part_validation():
    with pytest.raises(ValueError, match="role"):
        Message("", "hi")
    with pytest.raises(ValueError):
        ContentPart("image", text="no path")
    with pytest.raises(ValueError):
        ContentPart("audio", text="x")
    with pytest.raises(ValueError, match="tuple of ContentPart"):
        Message("user", ({"type": "text", "text": "hi"},))
