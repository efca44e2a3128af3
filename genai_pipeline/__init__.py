"""GenAI Pipeline: from an LLM checkpoint to verified ExecuTorch programs."""

__version__ = "0.2.0"
