"""Errors a user can act on. The CLI prints `error: <message>` on one line and exits non-zero."""


class GenAIError(Exception):
    """Base of every error meant for the user; its message says what is wrong and what to do."""


class UnknownModelError(GenAIError):
    pass


class CheckpointError(GenAIError):
    pass


class ExportError(GenAIError):
    pass


class ProgramError(GenAIError):
    """A .pte that is missing, truncated, corrupt or not one of ours."""


class InputError(GenAIError):
    """A bad prompt or option value at run time."""


class DataError(GenAIError):
    """Calibration data that is missing, malformed or empty, or a `--calib` spec naming no known dataset."""


class ChatTemplateError(DataError):
    """A chat template that does not parse, or fails to render a conversation (e.g. its `raise_exception`)."""


class ContextFullError(InputError):
    """A conversation that no longer fits the program's context."""
