"""Audio clips projected onto the audio tokens (Phi-4-multimodal), counted symbolically in the clips
and their padded feature frames.

Phi-4-multimodal's processor sends ``audio_input_features`` (clips, frames, mel bins) padded to the
longest clip, ``audio_attention_mask`` (each clip's frames) and ``audio_embed_sizes`` (each clip's
audio tokens). Its audio embedding (transformers, ``models/phi4_multimodal/modeling_phi4_multimodal.py``,
``Phi4MultimodalAudioEmbedding.forward``)

1. runs the conformer encoder on every padded frame of every clip: a convolutional subsampling, a
   relative attention bias, and blocks whose attention mask is a streaming mask the encoder builds
   from the subsampled length with numpy (``_streaming_mask``: chunk starts, ``nonzero``; in training
   a random pattern), combined with the padding mask: masks change no counted work;
2. projects every padded frame (linear, GELU, linear);
3. concatenates each clip's first ``audio_embed_sizes[i]`` rows and writes them to the audio-token
   positions of ``input_ids`` (``index_put``): data movement.

So its work is in the clips and their padded frames only (input shapes), and the feature embedding
around it calls it only ``if (input_ids == audio_token_id).any()``: the number of audio tokens, a
**derived size** (``capture/derived.py``, :class:`~fxflops.capture.derived.TokenCount`) guarded ≥ 1,
decides that branch (``adapters/token_embeddings.py``, shared with the image embedding). While
capturing (the capture's twin only), the encoder's streaming mask is all-true of its shape, the
audio embedding runs steps 1 and 2 as the model does and writes one projected row, expanded to the
audio tokens, to the first token rows (a view: no counted work, forward or backward), and the
feature embedding runs its own code with the ``.any()`` of its audio-token test True. Exact under the matmul-family count (FlopCounterMode's, every MFU
convention); the masks' construction is left out of the trace, so a program with it refuses
``count="all"`` (``DerivedSize.leaves_out``). A call without audio tokens is captured without the
stand-ins and measured (``fxflops/islands.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fxflops.adapters.token_embeddings import TokenEmbedding, has_parts, standing_in, written_to_tokens
from fxflops.capture.derived import TracedSize
from fxflops.errors import CaptureError

TOKENS = "audio_tokens"
FEATURES = "audio_input_features"
# names of the audio inputs' dims: clips, their padded feature frames
AUDIO_DIMS = {FEATURES: {0: "clips", 1: "audio_frames"}, "audio_attention_mask": {0: "clips", 1: "audio_frames"}, "audio_embed_sizes": {0: "clips"}}
_EMBEDDING_INPUTS = {"input_ids", "inputs_embeds", FEATURES, "audio_embed_sizes", "audio_attention_mask"}
_PROJECTIONS = ("up_proj_for_speech", "down_proj_for_speech", "up_proj_for_vision_speech", "down_proj_for_vision_speech")


class AudioClips(TokenEmbedding):
    """The audio handling of one model (see the module docstring), or :meth:`of` None."""

    TOKENS, INPUT, CONFIG, TOKEN_ID = TOKENS, FEATURES, "audio_config", "audio_token_id"
    LEFT_OUT = "the encoder's streaming and padding masks (comparisons) and the per-clip selection"

    @staticmethod
    def is_owner(module: torch.nn.Module) -> bool:
        """An audio embedding with Phi-4-multimodal's parts: an ``encoder`` building a streaming mask,
        the speech and vision-speech projections, and a forward taking the audio-token ids, the
        embeddings and the audio inputs."""
        encoder = getattr(module, "encoder", None)
        streaming = isinstance(encoder, torch.nn.Module) and callable(getattr(encoder, "_streaming_mask", None))
        return streaming and has_parts(module, _PROJECTIONS, _EMBEDDING_INPUTS)

    @contextlib.contextmanager
    def capturing(self, model: torch.nn.Module, sizes: dict[str, TracedSize]) -> Iterator[None]:
        """While ``model`` (the capture's twin) is traced with the derived sizes ``sizes``: its audio
        encoder's streaming mask all-true, its audio embedding writing the projected frames' first row
        to the audio tokens, its feature embedding's audio-token test True (see the module docstring)."""
        if TOKENS not in sizes:
            yield
            return
        owner = model.get_submodule(self.owner)
        encoder = owner.encoder

        def streaming_mask(seq_len: Any, batch_size: Any, chunk_size: Any, left_chunk: Any) -> torch.Tensor:
            return torch.ones(batch_size, seq_len, seq_len, dtype=torch.bool)

        def embed(input_ids: torch.Tensor, inputs_embeds: torch.Tensor, audio_input_features: torch.Tensor,
                  audio_embed_sizes: Any = None, audio_attention_mask: Any = None, audio_projection_mode: str = "speech") -> torch.Tensor:
            tokens, ids = sizes[TOKENS]  # read while tracing: make_fx's own SymInt and tensor
            if input_ids is not ids:
                raise CaptureError(f"{type(owner).__name__} received input_ids other than the model's own")
            speech = audio_projection_mode == "speech"
            up = owner.up_proj_for_speech if speech else owner.up_proj_for_vision_speech
            down = owner.down_proj_for_speech if speech else owner.down_proj_for_vision_speech
            features = audio_input_features.to(device=up.bias.device, dtype=up.bias.dtype)
            projected = down(torch.nn.functional.gelu(up(encoder(features, audio_attention_mask))))
            rows = projected.reshape(-1, projected.shape[-1])[:1].expand(tokens, projected.shape[-1])
            return written_to_tokens(owner, inputs_embeds, rows, tokens)

        parent, feature_embedding = self.feature_embedding(model)
        with standing_in([(encoder, "_streaming_mask", streaming_mask), (owner, "forward", embed), (parent, "forward", feature_embedding)]):
            yield
