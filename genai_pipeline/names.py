"""The two namespaces that must not mix: artifact keys name .pte files, graph names name methods."""

from collections.abc import Collection
from enum import Enum


class ArtifactKey(str, Enum):
    """A .pte file of an artifact set: `<key>.pte`."""

    TEXT_DECODER = "text_decoder"
    TOKEN_EMBEDDING = "token_embedding"
    VISION_ENCODER = "vision_encoder"
    # The default multimodal layout: the components (an encoder, token_embedding, text_decoder) as
    # methods of one program.
    MULTIMODAL = "multimodal"


class GraphName(str, Enum):
    """A method inside one program."""

    # A text program's methods. `forward` alone, or `prefill`, is what ExecuTorch's TextLLMRunner
    # calls (docs/decisions/0035: why the one-token method is not its `decode`);
    # `prefill_chunk`, `decode_token` and `verify` are our runtime's.
    FORWARD = "forward"  # dynamic sequence length
    PREFILL = "prefill"  # hybrid: a chunk of 1 to N tokens (`--long-prefill-len N`, 0: none)
    PREFILL_CHUNK = "prefill_chunk"  # a static chunk of N tokens (`--prefill-len N`), for NPUs
    DECODE_TOKEN = "decode_token"  # one token
    # A multimodal program's methods: the names ExecuTorch's MultimodalRunner calls.
    TOKEN_EMBEDDING = "token_embedding"  # ids [1, T] -> embeddings [1, T, D]
    TEXT_DECODER = "text_decoder"  # embeddings [1, T, D] + input_pos [1] -> next-token logits [1, V]
    VISION_ENCODER = "vision_encoder"  # uint8 RGB [1, 3, S, S] -> image embeddings [1, N, D]
    AUDIO_ENCODER = "audio_encoder"  # float32 log-mel [1, n_mels, frames] -> audio embeddings [1, N, D]
    VERIFY = "verify"  # optional (`--verify-len`): logits after every token, for lookahead decoding


class Mode(str, Enum):
    """How the text decoder is cut into graphs."""

    HYBRID = "hybrid"  # prefill + prefill_chunk + decode_token in one program, weights and KV cache shared
    KV = "kv"  # decode_token only; prompts prefilled token by token
    DYNAMIC = "dynamic"  # one forward with dynamic length

    @property
    def graphs(self) -> tuple[GraphName, ...]:
        return {
            Mode.HYBRID: (GraphName.PREFILL_CHUNK, GraphName.DECODE_TOKEN),
            Mode.KV: (GraphName.DECODE_TOKEN,),
            Mode.DYNAMIC: (GraphName.FORWARD,),
        }[self]


def method_names(methods: Collection[str]) -> dict[GraphName, str]:
    """The method each graph is in a program with these `methods`. Exports from before ExecuTorch's
    runner conventions were followed (docs/decisions/0035) named the static chunk `prefill`, the
    chunk of any length `prefill_long` and the one-token method `decode`, a name no program of
    ours has since."""
    names = {graph: graph.value for graph in GraphName}
    if "decode" in methods:
        names |= {
            GraphName.PREFILL_CHUNK: "prefill",
            GraphName.PREFILL: "prefill_long",
            GraphName.DECODE_TOKEN: "decode",
        }
    return names
