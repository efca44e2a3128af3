"""A multimodal program (methods `token_embedding`, `text_decoder`, `vision_encoder`) behind the
text path's `prefill` / `step` interface, so the same generation loop drives it.

The prompt is token ids in which each image stands as a run of `tokens_per_image` `<image>` ids
(the Hugging Face processor's expansion). `prefill` embeds the ids, puts the next staged image's
embeddings where its run is (transformers' `masked_scatter`), and runs the decoder once.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from genai_pipeline.bundle import read_manifest
from genai_pipeline.errors import InputError, ProgramError
from genai_pipeline.names import ArtifactKey, GraphName
from genai_pipeline.image_processing import ImageProcessing, expand_prompt, image_frames, read_image
from genai_pipeline.runtime.program import load_program


def is_multimodal(manifest: dict) -> bool:
    return "vision" in manifest


class MultimodalSession:
    def __init__(self, folder: Path, verify: bool = False):
        folder = Path(folder)
        self.manifest = read_manifest(folder)
        try:
            vision = self.manifest["vision"]
            entry = self.manifest["artifacts"][ArtifactKey.MULTIMODAL.value]
            expected = self.manifest["files"][entry["file"]]
            self.max_seq_len = int(self.manifest["max_seq_len"])
            self.processing = ImageProcessing.from_dict(vision["preprocessing"])
            self.image_token_id = int(vision["image_token_id"])
        except (KeyError, ValueError, TypeError) as e:
            raise ProgramError(f"'{folder}/manifest.json' lacks {e}; re-export the model") from None
        self.program = load_program(folder / entry["file"], expected["bytes"], expected["sha256"] if verify else None)
        self._methods = {g: self.program.load_method(g.value) for g in
                         (GraphName.TOKEN_EMBEDDING, GraphName.TEXT_DECODER, GraphName.VISION_ENCODER)}
        self.frames: list[np.ndarray] = []  # uint8 [3, S, S] each, in prompt order
        self.vision_seconds = 0.0
        self.pos = 0

    def reset(self) -> None:
        self.pos = 0

    def encode_prompt(self, tokenizer, prompt: str, image_paths: list[Path], max_tiles: int = 0) -> list[int]:
        """The prompt's ids with every image expanded as the family's processor does; the images'
        frames are staged for `prefill`."""
        processing = dataclasses.replace(self.processing, max_tiles=max_tiles) if max_tiles else self.processing
        images = [image_frames(read_image(Path(p)), processing) for p in image_paths]
        ids = tokenizer.encode(expand_prompt(prompt, images, processing))
        n_image = sum(len(f.pixels) for f in images) * processing.tokens_per_image
        if len(ids) >= self.max_seq_len:
            raise InputError(
                f"the prompt is {len(ids)} tokens ({n_image} of them for {len(image_paths)} image(s)) but the program's context "
                f"is {self.max_seq_len}; use fewer or smaller images (--max-tiles), or re-export with a larger --max-seq-len"
            )
        self.frames = [frame for f in images for frame in f.pixels]
        return ids

    def _execute(self, graph: GraphName, inputs: list[torch.Tensor]) -> torch.Tensor:
        # Outputs live in the runtime's planned memory: the next call overwrites them.
        return self._methods[graph].execute(inputs)[0].clone()

    def _check_room(self, n: int) -> None:
        if self.pos + n > self.max_seq_len:
            raise InputError(f"{self.pos + n} tokens do not fit the program's context of {self.max_seq_len}")

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        if not tokens:
            raise InputError("the prompt is empty")
        self._check_room(len(tokens))
        embeddings = self._execute(GraphName.TOKEN_EMBEDDING, [torch.tensor([tokens], dtype=torch.long)])
        slots = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        n = self.processing.tokens_per_image
        if len(slots) != n * len(self.frames):
            raise InputError(f"the prompt holds {len(slots)} image token(s) for {len(self.frames)} image frame(s) of {n} each")
        start = time.perf_counter()
        for k, frame in enumerate(self.frames):
            features = self._execute(GraphName.VISION_ENCODER, [torch.from_numpy(frame).unsqueeze(0)])
            embeddings[0, slots[k * n : (k + 1) * n]] = features[0]
        self.vision_seconds = time.perf_counter() - start
        self.frames = []
        logits = self._execute(GraphName.TEXT_DECODER, [embeddings, torch.tensor([self.pos], dtype=torch.long)])
        self.pos += len(tokens)
        return logits.reshape(-1, logits.shape[-1])[-1]

    def step(self, token: int) -> torch.Tensor:
        self._check_room(1)
        embedding = self._execute(GraphName.TOKEN_EMBEDDING, [torch.tensor([[token]], dtype=torch.long)])
        logits = self._execute(GraphName.TEXT_DECODER, [embedding, torch.tensor([self.pos], dtype=torch.long)])
        self.pos += 1
        return logits.reshape(-1, logits.shape[-1])[-1]

    def score(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` (text only) at the cursor; returns the logits after every one, [T, vocab]:
        one step each, as `text_decoder` returns the last position's logits only."""
        self._check_room(len(tokens))
        return torch.stack([self.step(token) for token in tokens])
