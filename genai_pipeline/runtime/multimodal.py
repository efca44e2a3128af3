"""A multimodal export behind the Session protocol (runtime/session.py), so the same generation
loop drives it. Two layouts: one program with methods `token_embedding`, `text_decoder` and
`vision_encoder` or `audio_encoder` (ExecuTorch's MultimodalRunner's), or `--split` (vision only):
`vision_encoder.pte` and `token_embedding.pte` (method `forward`) and `text_decoder.pte`
(`forward`, or `prefill_chunk` + `decode_token`).

The prompt is token ids in which each encoder input (an image's frame, an audio clip's 30 s chunk)
stands as a run of media token ids (`<image>`, `[AUDIO]`: the Hugging Face processor's expansion),
as many as the encoder makes of it (`tokens_of`: fixed per program, or per image for Qwen2-VL).
`prefill` embeds the ids, puts the next staged input's embeddings where its run is (transformers'
`masked_scatter`), and runs the decoder.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from genai_pipeline.audio_files import read_audio
from genai_pipeline.audio_processing import AudioClip, AudioProcessing, audio_clip, expand_audio_prompt
from genai_pipeline.errors import InputError
from genai_pipeline.image_files import read_image
from genai_pipeline.image_processing import Frames, ImageProcessing, expand_prompt, frame_tokens, image_frames
from genai_pipeline.manifest import SPLIT, Manifest
from genai_pipeline.names import ArtifactKey, GraphName, Mode, method_names
from genai_pipeline.runtime.program import load_program
from genai_pipeline.runtime.session import CacheCursor, check_runnable
from genai_pipeline.upstream.executorch_logs import native_logs_hidden


def is_multimodal(manifest: Manifest) -> bool:
    return manifest.vision is not None or manifest.audio is not None


def media_runs(slots: list[int], counts: list[int], modality: str, where: str = "the prompt") -> list[list[int]]:
    """The positions `slots` of the media tokens, cut into each encoder input's run (`counts` tokens each)."""
    if len(slots) != sum(counts):
        raise InputError(
            f"{where} holds {len(slots)} {modality} token(s) for {len(counts)} {modality} input(s) that take {sum(counts)}"
        )
    ends = np.cumsum([0, *counts])
    return [slots[a:b] for a, b in zip(ends, ends[1:])]


class MultimodalSession(CacheCursor):
    """No `verify` method: a vision-language program's decoder returns the last row's logits only.
    After a rewind into an image's run of tokens, the whole run is fed again, its frame staged again
    (as Chat does)."""

    def __init__(self, folder: Path, verify: bool = False):
        folder = Path(folder)
        self.manifest = Manifest.read(folder)
        if not is_multimodal(self.manifest):
            raise InputError(f"'{folder}' holds a text-only model; open it with open_session")
        check_runnable(folder, self.manifest)
        vision, audio = self.manifest.vision, self.manifest.audio
        self.max_seq_len = self.manifest.max_seq_len
        # what the prompt's media are: images (frames) or audio (log-mel chunks)
        self.modality = "image" if vision is not None else "audio"
        if vision is not None:
            self.processing = ImageProcessing.from_dict(vision["preprocessing"])
            self.image_token_id = self.media_token_id = vision["image_token_id"]
            self.tokens_per_frame = self.processing.tokens_per_image
            self.encoder = GraphName.VISION_ENCODER
        else:
            self.processing = AudioProcessing.from_dict(audio["preprocessing"])
            self.image_token_id, self.media_token_id = None, audio["audio_token_id"]
            self.tokens_per_frame = self.processing.tokens_per_chunk
            self.encoder = GraphName.AUDIO_ENCODER
        self.split = vision is not None and vision["layout"] == SPLIT
        self.mode = self.manifest.mode if self.split else Mode.DYNAMIC
        self.prefill_len = self.manifest.prefill_len
        keys = (
            (ArtifactKey.TOKEN_EMBEDDING, ArtifactKey.TEXT_DECODER, ArtifactKey.VISION_ENCODER)
            if self.split
            else (ArtifactKey.MULTIMODAL,)
        )
        files = {key: self.manifest.artifacts[key].file for key in keys}
        expected = {key: self.manifest.files[file] for key, file in files.items()}
        programs = {
            key: load_program(folder / files[key], expected[key].bytes, expected[key].sha256 if verify else None)
            for key in keys
        }
        with native_logs_hidden():
            if self.split:
                # the encoder and the embedding have one method, `forward`
                decoder = programs[ArtifactKey.TEXT_DECODER]
                names = method_names(decoder.method_names)
                self._methods = {
                    GraphName.TOKEN_EMBEDDING: programs[ArtifactKey.TOKEN_EMBEDDING].load_method(
                        GraphName.FORWARD.value
                    ),
                    GraphName.VISION_ENCODER: programs[ArtifactKey.VISION_ENCODER].load_method(GraphName.FORWARD.value),
                    **{g: decoder.load_method(names[g]) for g in self.mode.graphs},
                }
            else:
                self._methods = {
                    g: programs[ArtifactKey.MULTIMODAL].load_method(g.value)
                    for g in (GraphName.TOKEN_EMBEDDING, GraphName.TEXT_DECODER, self.encoder)
                }
        # the encoder's inputs (uint8 [3, S, S] frames, float32 [n_mels, frames] chunks), in prompt order: the next prefill's
        self.frames: list[np.ndarray] = []
        self.vision_seconds = 0.0  # the last prefill's time in the encoder (vision or audio)
        self.vision_calls = 0  # encoder inputs encoded since the session was made
        self.pos = 0

    def tokens_of(self, encoder_input: np.ndarray) -> int:
        """The media tokens the encoder makes of one input (a frame, an audio chunk)."""
        return frame_tokens(encoder_input, self.processing) if self.modality == "image" else self.tokens_per_frame

    def read_frames(self, path: Path, max_tiles: int = 0) -> Frames:
        """An image file as the encoder's frames, preprocessed as the family's processor does."""
        processing = dataclasses.replace(self.processing, max_tiles=max_tiles) if max_tiles else self.processing
        return image_frames(read_image(Path(path)), processing)

    def read_audio(self, path: Path) -> AudioClip:
        """A WAV or FLAC file as the encoder's log-mel chunks, as the family's processor makes them."""
        p = self.processing
        chunks = self.max_seq_len // self.tokens_per_frame  # what the context could hold, the prompt aside
        why = (
            f"the program's context is {self.max_seq_len} tokens, {p.tokens_per_chunk} per {p.chunk_length} s of audio: "
            f"at most {chunks * p.chunk_length} s fit; pass a shorter file, or re-export with a larger --max-seq-len"
        )
        return audio_clip(read_audio(Path(path), p.sampling_rate, chunks * p.chunk_length, why), p)

    def read_media(self, path: Path, max_tiles: int = 0) -> Frames | AudioClip:
        return self.read_frames(path, max_tiles) if self.modality == "image" else self.read_audio(path)

    @staticmethod
    def encoder_inputs(media: Frames | AudioClip) -> tuple[np.ndarray, ...]:
        return media.pixels if isinstance(media, Frames) else media.chunks

    def encode_prompt(self, tokenizer, prompt: str, paths: list[Path], max_tiles: int = 0) -> list[int]:
        """The prompt's ids with every image (or audio clip) expanded as the family's processor
        does; their encoder inputs are staged for `prefill`."""
        media = [self.read_media(p, max_tiles) for p in paths]
        if self.modality == "image":
            ids = tokenizer.encode(expand_prompt(prompt, media, self.processing))
        else:
            ids = tokenizer.encode(expand_audio_prompt(prompt, media, self.processing))
        inputs = [x for m in media for x in self.encoder_inputs(m)]
        if len(ids) >= self.max_seq_len:
            what, fix = (
                ("image(s)", "fewer or smaller images (--max-tiles)")
                if self.modality == "image"
                else ("audio file(s)", "fewer or shorter audio files")
            )
            raise InputError(
                f"the prompt is {len(ids)} tokens ({len(inputs) * self.tokens_per_frame} of them for {len(paths)} {what}) "
                f"but the program's context is {self.max_seq_len}; use {fix}, or re-export with a larger --max-seq-len"
            )
        self.frames = inputs
        return ids

    def _execute(self, graph: GraphName, inputs: list[torch.Tensor]) -> torch.Tensor:
        # Outputs live in the runtime's planned memory: the next call overwrites them.
        with native_logs_hidden():
            return self._methods[graph].execute(inputs)[0].clone()

    def _decode(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Embeddings [1, T, D] fed at the cursor; the next-token logits, [vocab]. A hybrid text
        decoder takes them in `prefill_chunk` chunks, a partial last chunk padded as the text path does
        (runtime/session.py): its last real row goes once more through `decode_token`."""
        if self.mode is Mode.DYNAMIC:
            graph = GraphName.FORWARD if self.split else GraphName.TEXT_DECODER
            logits = self._execute(graph, [embeddings, torch.tensor([self.pos], dtype=torch.long)])
            self.pos += embeddings.shape[1]
            return logits.reshape(-1, logits.shape[-1])[-1]
        i, n, total = 0, self.prefill_len, embeddings.shape[1]
        while total > 1 and i < total and self.pos + n <= self.max_seq_len:  # one embedding (a step): decode
            chunk = embeddings[:, i : i + n]
            padded = torch.cat([chunk, chunk.new_zeros((1, n - chunk.shape[1], chunk.shape[2]))], dim=1)
            logits = self._execute(GraphName.PREFILL_CHUNK, [padded, torch.tensor([self.pos], dtype=torch.long)])
            self.pos += chunk.shape[1]
            i += chunk.shape[1]
            if chunk.shape[1] < n:
                self.pos -= 1
                i -= 1
                break
        for row in range(i, total):  # a re-fed last row, or a tail too close to the end of the cache
            logits = self._execute(
                GraphName.DECODE_TOKEN, [embeddings[:, row : row + 1], torch.tensor([self.pos], dtype=torch.long)]
            )
            self.pos += 1
        return logits.reshape(-1, logits.shape[-1])[-1]

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """The staged encoder inputs go where the media tokens of `tokens` are, in order: each is
        encoded here, once; media tokens already in the cache are not fed again."""
        if not tokens:
            raise InputError("the prompt is empty")
        self._check_room(len(tokens))
        embeddings = self._execute(GraphName.TOKEN_EMBEDDING, [torch.tensor([tokens], dtype=torch.long)])
        slots = [i for i, t in enumerate(tokens) if t == self.media_token_id]
        runs = media_runs(slots, [self.tokens_of(f) for f in self.frames], self.modality)
        start = time.perf_counter()
        for frame, run in zip(self.frames, runs):
            features = self._execute(self.encoder, [torch.from_numpy(frame).unsqueeze(0)])
            self.vision_calls += 1
            embeddings[0, run] = features[0]
        self.vision_seconds = time.perf_counter() - start
        self.frames = []
        return self._decode(embeddings)

    def step(self, token: int) -> torch.Tensor:
        self._check_room(1)
        embedding = self._execute(GraphName.TOKEN_EMBEDDING, [torch.tensor([[token]], dtype=torch.long)])
        return self._decode(embedding)

    def score(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` (text only) at the cursor; returns the logits after every one, [T, vocab]:
        one step each, as `text_decoder` returns the last position's logits only."""
        self._check_room(len(tokens))
        return torch.stack([self.step(token) for token in tokens])


class EagerMultimodalSession(CacheCursor):
    """An eager VisionLanguageModel (the float one, or a dynamic recipe's) behind the Session
    protocol, fed as MultimodalSession feeds its program: embeddings of the ids, each staged frame's
    embeddings where its `<image>` run is, the decoder."""

    def __init__(self, model, image_token_id: int):
        self.model, self.image_token_id = model, image_token_id
        self.max_seq_len = model.decoder.max_seq_len
        self.frames: list[np.ndarray] = []
        self.pos = 0

    @torch.no_grad()
    def _decode(self, rows: torch.Tensor, last_only: bool = True) -> torch.Tensor:
        """The logits after the last of `rows` (embeddings with the columns the program's carry), or
        after every row, [rows, vocab]."""
        self._check_room(rows.shape[1])
        with native_logs_hidden():  # ExecuTorch's custom ops log from C++ in eager mode too
            logits = self.model.decode(rows, torch.tensor([self.pos]), last_only=last_only)
        self.pos += rows.shape[1]
        return logits.reshape(-1, logits.shape[-1])

    @torch.no_grad()
    def prefill(self, tokens: list[int]) -> torch.Tensor:
        rows = self.model.text_rows(torch.tensor([tokens]))
        images = [self.model.image_rows(torch.from_numpy(frame).unsqueeze(0))[0] for frame in self.frames]
        slots = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        for image, run in zip(images, media_runs(slots, [len(image) for image in images], "image")):
            rows[0, run] = image
        self.frames = []
        return self._decode(rows)[-1]

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        return self._decode(self.model.text_rows(torch.tensor([[token]])))[-1]

    @torch.no_grad()
    def score(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` (text only) at the cursor; the logits after every one, [T, vocab]."""
        return self._decode(self.model.text_rows(torch.tensor([tokens])), last_only=False)
