"""GenAI Pipeline: from an LLM checkpoint to verified ExecuTorch programs."""

__version__ = "0.1.0"
