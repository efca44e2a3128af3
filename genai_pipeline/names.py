"""The two namespaces that must not mix: artifact keys name .pte files, graph names name methods."""

from enum import Enum


class ArtifactKey(str, Enum):
    """A .pte file of an artifact set: `<key>.pte`."""

    TEXT_DECODER = "text_decoder"
    TOKEN_EMBEDDING = "token_embedding"
    VISION_ENCODER = "vision_encoder"


class GraphName(str, Enum):
    """A method inside one program."""

    PREFILL = "prefill"  # static chunk of N tokens
    DECODE = "decode"  # one token
    FORWARD = "forward"  # dynamic sequence length (ExecuTorch LLM runner convention)
    VERIFY = "verify"  # optional (`--verify-len`): logits after every token, for lookahead decoding


class Mode(str, Enum):
    """How the text decoder is cut into graphs."""

    HYBRID = "hybrid"  # prefill + decode in one program, weights and KV cache shared
    KV = "kv"  # decode only; prompts prefilled token by token
    DYNAMIC = "dynamic"  # one forward with dynamic length

    @property
    def graphs(self) -> tuple[GraphName, ...]:
        return {
            Mode.HYBRID: (GraphName.PREFILL, GraphName.DECODE),
            Mode.KV: (GraphName.DECODE,),
            Mode.DYNAMIC: (GraphName.FORWARD,),
        }[self]
