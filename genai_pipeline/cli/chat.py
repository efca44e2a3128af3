"""`genai run --chat`: a conversation on stdin, replies streamed to stdout."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("genai_pipeline")


def chat(args, session, tokenizer, sampler, lookahead) -> int:
    """`genai run --chat`: user messages from stdin (--prompt first), replies streamed to stdout."""
    from genai_pipeline.chat_template import read_chat_template
    from genai_pipeline.errors import ContextFullError, InputError
    from genai_pipeline.runtime.chat import Chat, end_of_turn_ids
    from genai_pipeline.tokenizer import TextStream

    folder = Path(args.folder)
    template = read_chat_template(folder)
    if template is None:
        raise InputError(
            f"'{folder}' has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); "
            "write one there as chat_template.jinja, or export from a checkpoint that has one"
        )
    stop_ids = end_of_turn_ids(folder, tokenizer, session.manifest.eos_ids, template)
    chat = Chat(
        session, tokenizer, template, sampler, stop_ids, args.max_new_tokens, system=args.system, lookahead=lookahead
    )
    for image in args.image:  # --image with --chat: for the first message
        chat.attach_image(Path(image), args.max_tiles)
    for audio in args.audio:  # --audio likewise
        chat.attach_audio(Path(audio))
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  line editing and history for input()

        log.info(
            "chat with %s: %s/reset clears the conversation, /exit or Ctrl-D quits",
            session.manifest.model,
            "/image PATH attaches an image to your next message, "
            if chat.takes_images
            else "/audio PATH attaches a WAV or FLAC file to your next message, "
            if chat.takes_audio
            else "",
        )
    for text in _user_messages(args.prompt, interactive):
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            chat.reset()
            log.info("conversation cleared")
            continue
        command = text.strip().split(maxsplit=1)[:1]
        if command in (["/image"], ["/audio"]):
            path = text.strip()[len(command[0]) :].strip()
            try:
                if not path:
                    raise InputError(f"{command[0]} needs a path: {command[0]} PATH")
                if command == ["/image"]:
                    chat.attach_image(Path(path), args.max_tiles)
                else:
                    chat.attach_audio(Path(path))
            except InputError as e:  # a bad file: one line, the conversation goes on
                log.warning("%s", e)
                continue
            log.info("%s goes with your next message", path)
            continue
        if not text.strip():
            continue
        stream = TextStream(tokenizer)
        try:
            reply = chat.send(text, on_token=lambda token: print(stream.push(token), end="", flush=True))
        except ContextFullError as e:  # this message alone: earlier turns are dropped as needed
            log.warning("%s; send a shorter message, or re-export with a larger --max-seq-len", e)
            continue
        except InputError as e:  # e.g. a template that does not mark images
            log.warning("%s", e)
            continue
        print(stream.flush(), flush=True)
        if reply.dropped:
            log.info("(the %d oldest turn(s) left the conversation to fit the context)", reply.dropped)
        if reply.stop_reason == "context":
            log.warning(
                "the reply filled the program's context of %d tokens with this message alone; "
                "re-export with a larger --max-seq-len for longer replies",
                session.max_seq_len,
            )
        log.debug(
            "kept %d cached tokens, prefilled %d, replied %d (%s)",
            reply.reused,
            reply.prefilled,
            len(reply.tokens),
            reply.stop_reason,
        )
    return 0


def _user_messages(first: str | None, interactive: bool):
    """--prompt, then stdin line by line until its end (Ctrl-D)."""
    if first is not None:
        yield first
    while True:
        try:
            yield input("> " if interactive else "")
        except EOFError:
            if interactive:
                print()  # the shell's prompt starts on a line of its own
            return
