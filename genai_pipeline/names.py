"""The two namespaces that must not mix: artifact keys name .pte files, graph names name methods."""

from enum import Enum


class ArtifactKey(str, Enum):
    """A .pte file of an artifact set: `<key>.pte`."""

    TEXT_DECODER = "text_decoder"
    TOKEN_EMBEDDING = "token_embedding"
    VISION_ENCODER = "vision_encoder"
    # The default multimodal layout: the three components above as methods of one program.
    MULTIMODAL = "multimodal"


class GraphName(str, Enum):
    """A method inside one program."""

    PREFILL = "prefill"  # static chunk of N tokens
    DECODE = "decode"  # one token
    FORWARD = "forward"  # dynamic sequence length (ExecuTorch LLM runner convention)
    # A multimodal program's methods: the names ExecuTorch's MultimodalRunner calls.
    TOKEN_EMBEDDING = "token_embedding"  # ids [1, T] -> embeddings [1, T, D]
    TEXT_DECODER = "text_decoder"  # embeddings [1, T, D] + input_pos [1] -> next-token logits [1, V]
    VISION_ENCODER = "vision_encoder"  # uint8 RGB [1, 3, S, S] -> image embeddings [1, N, D]
    VERIFY = "verify"  # optional (`--verify-len`): logits after every token, for lookahead decoding
    PREFILL_LONG = "prefill_long"  # hybrid, optional (`--long-prefill-len N`): a chunk of 1 to N tokens


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
