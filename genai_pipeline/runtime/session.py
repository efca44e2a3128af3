"""The Session protocol, which every session implements, and the sessions of a text decoder: its
program (DecoderSession) and an eager model (EagerSession).

A session is a KV cache and its cursor `pos`, the number of cache positions holding real tokens:
prefill a prompt, then step one token at a time. Every session's cache is read through causal masks
built from explicit positions (models/decoder.py, models/cache_io.py), so cache rows at and past the
cursor are never read, and the next call overwrites them: moving the cursor back truncates the
cache, at no cost. A program's cache lives inside the runtime (a mutable buffer shared by its
methods); Python only tracks `pos`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from genai_pipeline.errors import InputError, ProgramError
from genai_pipeline.manifest import QDQ_ONLY, Manifest
from genai_pipeline.names import ArtifactKey, GraphName, Mode, method_names
from genai_pipeline.runtime.program import load_program, qnn_runtime_missing
from genai_pipeline.upstream.executorch_logs import native_logs_hidden


def check_runnable(folder: Path, manifest: Manifest) -> None:
    if manifest.status == QDQ_ONLY:
        raise ProgramError(
            f"'{folder}' holds only a QDQ model: lowering to {manifest.target} was not possible "
            "where it was exported; `genai eval` evaluates it"
        )
    if manifest.target == "qnn":  # else the runtime fails deep in QnnExecuTorchBackend::init
        if (why := qnn_runtime_missing()) is not None:
            raise ProgramError(f"'{folder}': {why}")


def check_room(positions: int, max_seq_len: int) -> None:
    """One line when a session would run past the program's context (every session's check)."""
    if positions > max_seq_len:
        raise InputError(
            f"{positions} tokens do not fit the program's context of {max_seq_len}; "
            "use a shorter prompt / fewer new tokens, or re-export with a larger --max-seq-len"
        )


def check_constants(program, path: Path, manifest: Manifest) -> None:
    """The program's own metadata methods against its manifest: a program of another export under
    this manifest (its sizes and sha256 copied over) is refused here, not deep inside a run."""
    for method, want in (
        ("get_vocab_size", manifest.config.vocab_size),
        ("get_n_layers", manifest.config.n_layers),
        ("get_max_context_len", manifest.max_seq_len),
    ):
        if method not in program.method_names:
            continue
        with native_logs_hidden():
            got = program.load_method(method).execute([])[0]
        if got != want:
            raise ProgramError(
                f"'{path}' is a program with {method.removeprefix('get_').replace('_', ' ')} {got}, but its "
                f"manifest says {want}: the folder mixes two exports; re-export"
            )


@runtime_checkable
class Session(Protocol):
    """What `generate`, lookahead decoding, `Chat`, `genai eval` and a server drive: every session
    class (the program's, the cache-I/O program's, the multimodal one's, the eager ones) has it."""

    pos: int  # cache positions holding real tokens: the next token fed goes here
    max_seq_len: int  # the context: positions the cache holds
    verify_len: int  # tokens one `verify` call takes at most; 0: the program has no `verify`

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` at the cursor; the next-token logits, [vocab]."""

    def step(self, token: int) -> torch.Tensor:
        """Feed one token at the cursor; the next-token logits, [vocab]."""

    def score(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` at the cursor; the logits after every one of them, [T, vocab]."""

    def can_verify(self, n: int) -> bool:
        """Whether one `verify` call takes `n` tokens at the cursor."""

    def verify_rows(self, n: int) -> int:
        """The rows a `verify` call of `n` tokens computes (its padding included)."""

    def verify(self, tokens: list[int]) -> torch.Tensor:
        """`score` in one call: the cursor moves past all of `tokens`."""

    def reset(self) -> None:
        """Forget every token: the same as `rewind(0)`."""

    def rewind(self, pos: int) -> None:
        """Keep the first `pos` positions of the cache (pos <= the cursor): the next token fed goes at `pos`."""


class CacheCursor:
    """What every session class shares: the cursor, its moves back, the room check, and the rule of
    `verify` (none unless `verify_len`; a subclass with a `verify` method overrides `verify`)."""

    pos: int
    max_seq_len: int
    verify_len = 0

    def reset(self) -> None:
        self.pos = 0

    def rewind(self, pos: int) -> None:
        if not 0 <= pos <= self.pos:
            raise InputError(f"cannot rewind to position {pos}: the cache holds {self.pos} positions")
        self.pos = pos

    def _check_room(self, n: int) -> None:
        check_room(self.pos + n, self.max_seq_len)

    def verify_rows(self, n: int) -> int:
        return n

    def can_verify(self, n: int) -> bool:
        # A verify call writes cache rows for its padding too, so all its rows must fit the cache.
        return 1 <= n <= self.verify_len and self.pos + self.verify_rows(n) <= self.max_seq_len

    def _check_verify(self, n: int) -> None:
        if not self.can_verify(n):
            raise InputError(
                f"{n} tokens at position {self.pos} do not fit one verify call "
                f"(verify length {self.verify_len}, context {self.max_seq_len})"
            )

    def verify(self, tokens: list[int]) -> torch.Tensor:
        """`score`, where one call computes every row (an eager model's)."""
        self._check_verify(len(tokens))
        return self.score(tokens)


class DecoderSession(CacheCursor):
    def __init__(self, folder: Path, verify: bool = False):
        folder = Path(folder)
        self.folder = folder
        self.manifest = Manifest.read(folder)
        if self.manifest.vision is not None:
            raise InputError(f"'{folder}' holds a vision-language model; open it with open_session")
        check_runnable(folder, self.manifest)
        entry = self.manifest.artifacts[ArtifactKey.TEXT_DECODER]
        self.mode, self.max_seq_len, self.prefill_len = (
            self.manifest.mode,
            self.manifest.max_seq_len,
            self.manifest.prefill_len,
        )
        expected = self.manifest.files[entry.file]
        path = folder / entry.file
        self.program = load_program(path, expected.bytes, expected.sha256 if verify else None)
        check_constants(self.program, path, self.manifest)
        self._names = method_names(self.program.method_names)
        with native_logs_hidden():
            self._methods = {name: self.program.load_method(self._names[name]) for name in self.mode.graphs}
            # `verify` (exported with --verify-len): every token's logits, for lookahead decoding; of
            # any length up to verify_len, or (older exports) of that length only: shorter
            # drafts are padded at the end, as a prefill chunk.
            self.verify_len = self._load_optional(GraphName.VERIFY)
            self.verify_padded = GraphName.VERIFY.value not in entry.dynamic_methods
            # `prefill` (hybrid, --long-prefill-len N): chunks of 1 to N tokens
            self.long_prefill_len = self._load_optional(GraphName.PREFILL)
        self.pos = 0

    def _load_optional(self, graph: GraphName) -> int:
        """Load `graph` if the program has it; its tokens per call (the bound of a dynamic length), or 0."""
        name = self._names[graph]
        if name not in self.program.method_names:
            return 0
        self._methods[graph] = self.program.load_method(name)
        return int(self.program.metadata(name).input_tensor_meta(0).sizes()[1])

    def _run(self, graph: GraphName, tokens: list[int]) -> torch.Tensor:
        inputs = [torch.tensor([tokens], dtype=torch.long), torch.tensor([self.pos], dtype=torch.long)]
        # Every graph returns the logits after its last token, [1, vocab] (programs exported
        # before 0.2 return every row of a prefill chunk: the last row is the same thing). They
        # live in the runtime's planned memory and the next call overwrites them.
        with native_logs_hidden():
            out = self._methods[graph].execute(inputs)[0]
        return out.reshape(-1, out.shape[-1])[-1].clone()

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` at the cursor; returns the next-token logits, [vocab]."""
        if not tokens:
            raise InputError("the prompt is empty")
        self._check_room(len(tokens))
        if self.mode is Mode.DYNAMIC:
            logits = self._run(GraphName.FORWARD, tokens)
            self.pos += len(tokens)
            return logits
        if self.long_prefill_len:  # hybrid: chunks of any length, no padding
            for i in range(0, len(tokens), self.long_prefill_len):
                chunk = tokens[i : i + self.long_prefill_len]
                logits = self._run(GraphName.PREFILL, chunk)
                self.pos += len(chunk)
            return logits
        i, n = 0, self.prefill_len
        if self.mode is Mode.HYBRID:
            while i < len(tokens) and self.pos + n <= self.max_seq_len:
                chunk = tokens[i : i + n]
                logits = self._run(GraphName.PREFILL_CHUNK, chunk + [0] * (n - len(chunk)))
                self.pos += len(chunk)
                i += len(chunk)
                if len(chunk) < n:
                    # Padded at the end: causal attention keeps the padding out of every real
                    # token's cache rows, but the logits are the padding's. The last real token
                    # goes again through decode, which rewrites its own row and gives its logits.
                    self.pos -= 1
                    i -= 1
                    break
        for token in tokens[i:]:  # kv mode, a re-fed last token, or a tail too close to the end of the cache
            logits = self.step(token)
        return logits

    def score(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` at the cursor; returns the logits after every one of them, [T, vocab].
        One decode step each: the programs compute logits for the last position only."""
        self._check_room(len(tokens))
        return torch.stack([self.step(token) for token in tokens])

    def prefill_chunks(self, tokens: list[int]) -> torch.Tensor:
        """Feed the whole chunks of `tokens` at the cursor through `prefill_chunk` (a hybrid program;
        a partial last chunk is left out: its logits would be the padding's); returns what it
        returns, the logits after each chunk's last token, [chunks, vocab]. For `genai eval`."""
        if self.mode is not Mode.HYBRID:
            raise InputError(f"a {self.mode.value} program has no prefill_chunk method")
        n = self.prefill_len
        chunks = [tokens[i : i + n] for i in range(0, len(tokens) - n + 1, n)]
        self._check_room(n * len(chunks))
        logits = []
        for chunk in chunks:
            logits.append(self._run(GraphName.PREFILL_CHUNK, chunk))
            self.pos += n
        return torch.stack(logits) if logits else torch.empty(0)

    def step(self, token: int) -> torch.Tensor:
        """Feed one token at the cursor; returns the next-token logits, [vocab]."""
        self._check_room(1)
        logits = self._run(GraphName.FORWARD if self.mode is Mode.DYNAMIC else GraphName.DECODE_TOKEN, [token])
        self.pos += 1
        return logits

    def verify_rows(self, n: int) -> int:
        """The rows a `verify` call of `n` tokens computes (its padding included)."""
        return self.verify_len if self.verify_padded else n

    def verify(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` at the cursor in one call; returns the logits after every one, [T, vocab].
        The cursor moves past all of them: the caller rewinds to keep only the accepted ones."""
        self._check_verify(len(tokens))
        n = len(tokens)
        padded = tokens + [0] * (self.verify_rows(n) - n)
        inputs = [torch.tensor([padded], dtype=torch.long), torch.tensor([self.pos], dtype=torch.long)]
        out = self._methods[GraphName.VERIFY].execute(inputs)[0]
        self.pos += n
        # Padding comes after the real tokens: causal attention keeps it out of their rows.
        return out.reshape(-1, out.shape[-1])[:n].clone()


class EagerSession(CacheCursor):
    """An eager model behind the Session protocol, for parity checks and eval: anything called as
    `model(tokens [1, T], input_pos [1]) -> logits [1, T, vocab]` that keeps its own KV cache (our
    Decoder, or a QDQ model loaded from `.qdq.pt2`)."""

    def __init__(self, model, max_seq_len: int | None = None, verify_len: int = 0):
        self.model = model
        self.max_seq_len = max_seq_len or model.max_seq_len
        self.verify_len = verify_len  # > 0: lookahead decoding may `verify` up to this many tokens
        self.pos = 0

    @torch.no_grad()
    def score(self, tokens: list[int]) -> torch.Tensor:
        self._check_room(len(tokens))
        with native_logs_hidden():  # a QDQ model runs ExecuTorch's custom ops, which log from C++
            logits = self.model(torch.tensor([tokens]), torch.tensor([self.pos]))[0]
        self.pos += len(tokens)
        return logits

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        return self.score(tokens)[-1]

    def step(self, token: int) -> torch.Tensor:
        return self.score([token])[-1]
