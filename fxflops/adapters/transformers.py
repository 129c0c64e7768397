"""Hugging Face ``transformers`` models: captured with no per-model code.

``fxflops.instrument(model)`` and ``fxflops.trace(model, ...)`` use this adapter whenever ``model`` is a
``transformers.PreTrainedModel``. It handles the data-dependent parts of vision-language models from
what the model and transformers themselves declare, never from a list of model classes:

- **Metadata derived from the batch** (:meth:`TransformersAdapter.prepare`). Vision towers build their
  rotary positions, attention offsets and window indices from ``image_grid_thw`` with Python loops, and
  M-RoPE models build ``position_ids`` with ``get_rope_index``. transformers lets a caller pass these
  precomputed (``image_cu_seqlens``, ``image_position_ids``, ``image_cu_window_seqlens``, ...; see
  ``transformers.vision_utils``) and keeps, for ``torch.export``, a registry that computes them for any
  encoder that takes ``grid_thw`` (``transformers.exporters.utils.precompute_export_inputs``). The
  adapter runs that registry on the model's vision encoder, and the model's own ``get_rope_index``,
  on the real batch before every call. The model then skips its loops (the work is moved, not
  added), and the captured program binds the offsets as segment families. A base model whose
  ``get_<modality>_features`` lacks transformers' ``accepts_precomputed_kwargs`` gets it on the
  capture's twin only (:func:`_accepting_precomputed`).
- **Per-segment modules**: the innermost modules whose ``forward`` takes ``cu_seqlens`` (eager and sdpa
  vision attention loop over ``torch.split(q, lengths.tolist())``) are lifted (``capture/lifting.py``),
  billed Σₖ cₖ·pₖ over the offsets' segment power sums.
- **Per-image pieces** of ``get_image_features``/``get_video_features`` stay packed while capturing
  (``fxflops/adapters/pieces.py``), so the number of images is never fixed by the capture.
- **Mixture-of-experts layers** are traced through transformers' ``batched_mm`` experts
  implementation, whose shapes are static (:func:`_experts_as_batched_matmuls`).
- **Dims** are named ``batch``, ``seq``, ``patches``/``video_patches`` (packed vision inputs) or
  ``images``, ``height``, ``width`` (batched pixel inputs; ``videos``, ``video_frames`` of batched videos); the values
  per packed patch are static; any other dim is ``<argument>_<dim>``, free unless the model fixes it.

A family that derives metadata some other way gets the usual capture error naming the model line that
could not be traced (and with ``instrument``, an uncounted call and one warning), never a wrong count.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import torch

from fxflops.analysis.paths import inside
from fxflops.capture.adapters import Adapter
from fxflops.capture.inputs import bind_call, held_root, is_metadata, path_label, tensor_leaves
from fxflops.adapters.audio import AUDIO_DIMS, AudioClips
from fxflops.adapters.crops import CROP_DIMS, ImageCrops
from fxflops.adapters.frames import FRAME_DIMS, RealFrames
from fxflops.adapters.patch_grids import PatchGrids
from fxflops.adapters.pieces import packed_pieces
from fxflops.adapters.tiles import AnyresTiles
from fxflops.capture.derived import DerivedSize, TracedSize
from fxflops.errors import CaptureError, MetadataError
from fxflops.situation_code import plain

FEATURE_GETTERS = ("get_image_features", "get_video_features")
GRIDS = {"image": "image_grid_thw", "video": "video_grid_thw"}  # modality -> its grid argument
_GRID_NAMES = tuple(GRIDS.values())
TEXT_ARGUMENTS = ("input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids", "inputs_embeds")
PIXEL_ARGUMENTS = {"pixel_values": "patches", "pixel_values_videos": "video_patches"}
OFFSETS = "cu_seqlens"


def lifted_modules(model: torch.nn.Module) -> dict[str, str]:
    """``{module path pattern: "cu_seqlens"}`` for the innermost modules whose forward takes
    ``cu_seqlens`` (layer indices become ``*``)."""
    takes = [path for path, m in model.named_modules() if path and OFFSETS in _parameters(m.forward)]
    innermost = [p for p in takes if not any(q != p and inside(q, p) for q in takes)]
    return {re.sub(r"\.\d+(?=\.|$)", ".*", path): OFFSETS for path in innermost}


def _parameters(function: Any, ordered: bool = False) -> Any:
    """``function``'s parameter names (a set, or a list in order); empty when it has no signature."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        names = []
    return names if ordered else set(names)


def _vision_encoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The shallowest submodule whose forward takes ``grid_thw`` (the packed-patch vision tower)."""
    return next((m for _, m in model.named_modules() if "grid_thw" in _parameters(m.forward)), None)


def _rope_owner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The (sub)module defining ``get_rope_index`` (M-RoPE position ids), if any."""
    return next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)


class TransformersAdapter(Adapter):
    """The adapter for a ``transformers.PreTrainedModel`` (see the module docstring)."""

    # decoder layers store their index only to address the KV cache; every index-dependent choice
    # (layer_type, sliding_window, MoE or dense mlp) is an attribute or a submodule made in __init__
    same_layer_attributes = frozenset({"layer_idx"})
    # per-batch Python ints a padding-free collator (DataCollatorWithFlattening's flash-attention
    # kwargs) or a trainer passes: symbols, so that a new longest sequence is not a new situation
    symbolic_arguments = frozenset({"max_length_q", "max_length_k", "num_items_in_batch"})

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.per_segment = lifted_modules(model)
        self.encoder = _vision_encoder(model)
        self.rope = _rope_owner(model)
        self.derived: set[str] = set()  # the keyword arguments prepare() adds
        self._derived_by_grid: dict[tuple, dict[str, Any]] = {}  # _vision_metadata's cache
        self._encoder_settings = _settings_of(self.encoder) if self.encoder is not None else []
        self._signature = inspect.signature(model.forward)  # kept: prepare() binds calls on the hot path
        self.tiles = AnyresTiles.of(model, self._signature)  # images cut into tiles by their sizes (adapters/tiles.py)
        self.grids = PatchGrids.of(model, self._signature)  # patch grids cut by image sizes (adapters/patch_grids.py)
        self.frames = RealFrames.of(model, self._signature)  # padding frames dropped by value (adapters/frames.py)
        self.crops = ImageCrops.of(model, self._signature)  # image crops projected onto the image tokens (adapters/crops.py)
        self.audio = AudioClips.of(model, self._signature)  # audio clips projected onto the audio tokens (adapters/audio.py)
        self._rope_parameters = _parameters(self.rope.get_rope_index) if self.rope is not None else set()
        positional = list(_parameters(model.forward, ordered=True))
        # a call reaching a grid only past this many positional arguments: a quick "no media" test
        self._grid_after = min((positional.index(g) for g in GRIDS.values() if g in positional), default=len(positional))

    def prepare(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Add the metadata the model would derive with loops (see the module docstring). Metadata
        that cannot be derived (a grid that does not match the image tokens) raises
        :class:`~fxflops.errors.MetadataError` naming the inputs."""
        if self.tiles is not None:
            args, kwargs = self.tiles.prepare(args, kwargs)
        if len(args) <= self._grid_after and (kwargs.keys().isdisjoint(_GRID_NAMES) or all(kwargs.get(g) is None for g in _GRID_NAMES)):
            return args, kwargs  # text only: nothing to derive (and no binding on this hot path)
        call = bind_call(self.model.forward, args, kwargs, self._signature)
        extras: dict[str, Any] = {}
        for modality, grid_name in GRIDS.items():
            grid = call.get(grid_name)
            if grid is None or self.encoder is None:
                continue
            pixels = call.get("pixel_values" if modality == "image" else "pixel_values_videos")
            # a grid on the host is checked here; on an accelerator that read would be a sync, and the
            # binder's offsets check covers it (strict_metadata)
            if pixels is not None and pixels.dim() == 2 and grid.is_cpu and int(grid.prod(-1).sum()) != pixels.shape[0]:
                raise MetadataError(
                    f"{grid_name} describes {int(grid.prod(-1).sum())} patches (the sum of t·h·w), but "
                    f"{'pixel_values' if modality == 'image' else 'pixel_values_videos'} has {pixels.shape[0]} rows"
                )
            with _naming(f"{type(self.encoder).__name__}'s vision metadata", [grid_name]):
                derived = self._vision_metadata(grid)
            for key, value in derived.items():  # what the caller passed precomputed is kept
                if value is not None and f"{modality}_{key}" not in call:
                    extras[f"{modality}_{key}"] = value
        if self.rope is not None and call.get("position_ids") is None and any(call.get(g) is not None for g in GRIDS.values()):
            self._rope_positions(call, extras)
        self.derived.update(extras)
        return (args, {**kwargs, **extras}) if extras else (args, kwargs)

    def _rope_positions(self, call: dict[str, Any], extras: dict[str, Any]) -> None:
        """M-RoPE ``position_ids`` derived as the model derives them when it is not given them: with
        its ``get_rope_index`` (per-image Python loops), storing the ``rope_deltas`` it returns where
        the model keeps them (the next decode step continues from them), unless the call continues
        a key-value cache from stored deltas, which the model's own code does without loops."""
        cache = call.get("cache", call.get("past_key_values"))
        cached = cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0
        keeps = "rope_deltas" in vars(self.rope)
        if cached and keeps and self.rope.rope_deltas is not None:
            return
        given = {k: v for k, v in call.items() if k in self._rope_parameters and v is not None}
        with _naming(f"{type(self.rope).__name__}.get_rope_index", sorted(given)):
            extras["position_ids"], deltas = self.rope.get_rope_index(**given)
        if keeps:
            self.rope.rope_deltas = deltas

    def _vision_metadata(self, grid: torch.Tensor) -> dict[str, Any]:
        """The encoder's loop-built inputs for ``grid`` (cu_seqlens, positions, window indices: a
        function of the grid's values and the encoder's settings), kept per grid and settings on the
        host: a dataset of few resolutions derives each once (transformers' precomputation walks the
        encoder's modules for its attributes on every call), and a setting changed between calls
        (Qwen2.5-VL's ``window_size``) derives them again. Emptied past 256 grids."""
        settings = tuple(_frozen(namespace.get(name)) for namespace, name in self._encoder_settings)
        key = (grid.dtype, tuple(grid.shape), grid.numpy().tobytes(), settings) if grid.is_cpu and not grid.requires_grad else None
        found = self._derived_by_grid.get(key) if key is not None else None
        if found is None:
            inputs: dict[str, Any] = {"grid_thw": grid}
            _precompute_encoder_inputs(self.encoder, inputs)
            found = {k: v for k, v in inputs.items() if k != "grid_thw"}
            if key is not None:
                if len(self._derived_by_grid) >= 256:
                    self._derived_by_grid.clear()
                self._derived_by_grid[key] = found
        return found

    def dims(self, args: tuple, kwargs: dict) -> dict[str, dict[int, str]]:
        """Every tensor dim of the call named: batch/seq on text inputs, past on a key-value cache's
        keys and values, patches on packed pixels, images on batched pixels, ``<argument>_<dim>``
        elsewhere and where a known name's sizes disagree (a decode step's mask is past + 1 long).
        A dim of size 1 stays 1 (it broadcasts, or it is a decode step's one token) unless it
        counts items (:data:`COUNTS`, the rows of integer metadata). Of the derived metadata only dim 0 varies: the modality's
        patches when it runs along them (rotary positions, interpolation taps), else its own symbol
        (offsets, window indices)."""
        call = bind_call(self.model.forward, args, kwargs)
        named: dict[str, dict[int, str]] = {}
        sizes: dict[str, int] = {}  # example size of each known name given so far
        for path, tensor in tensor_leaves(call).items():
            label = path_label(path)
            modality = str(path[0]).split("_")[0]
            if path[0] in self.derived and modality in GRIDS:
                pixels = call.get("pixel_values" if modality == "image" else "pixel_values_videos")
                along = pixels is not None and pixels.dim() == 2 and tensor.dim() and tensor.shape[0] == pixels.shape[0]
                named[label] = {0: PIXEL_ARGUMENTS["pixel_values" if modality == "image" else "pixel_values_videos"] if along else f"{label}_0"}
                continue
            cached = _in_cache(call, path)  # heads and head size of a cache layer are the config's: static
            names = {  # a size-1 dim broadcasts (a mask's heads): static unless it counts rows of metadata
                d: f"{label}_{d}" for d in range(tensor.dim())
                if (tensor.shape[d] != 1 or (d == 0 and is_metadata(tensor))) and (not cached or tensor.dim() != 4 or d in (0, 2))
            }
            known = _cache_dims(tensor.dim()) if cached else _known_dims(label, tensor.dim())
            if self.tiles is not None and label == "pixel_values" and tensor.dim() == 4:
                known = {**known, 0: "tiles"}  # the images' tiles (prepare() packed them)
            if self.frames is not None and label in FRAME_DIMS and max(FRAME_DIMS[label]) == tensor.dim() - 1:
                known = {**known, **FRAME_DIMS[label]}  # frames padded per sequence (adapters/frames.py)
            if self.crops is not None and label in CROP_DIMS and tensor.dim() >= 3:
                known = {**known, **CROP_DIMS[label]}  # crops padded per image (adapters/crops.py)
            if self.audio is not None and label in AUDIO_DIMS and tensor.dim() > max(AUDIO_DIMS[label]):
                known = {**known, **AUDIO_DIMS[label]}  # clips padded to the longest (adapters/audio.py)
            for d, name in known.items():  # a known name only where its sizes agree
                if tensor.shape[d] == 1 and name not in COUNTS:
                    continue  # a length of 1 (a decode step's one token) is another program, never a symbol
                if sizes.setdefault(name, tensor.shape[d]) == tensor.shape[d]:
                    names[d] = name
            if label in PIXEL_ARGUMENTS and tensor.dim() == 2:
                del names[1]  # values per patch (channels x temporal x patch²): fixed by the config
            if label == "image_sizes" and tensor.dim() == 2:
                names.pop(1, None)  # (height, width) of each image: two columns
            named[label] = names
        return named

    def derived_sizes(self, args: tuple, kwargs: dict) -> tuple[DerivedSize, ...]:
        """The patches a Pixtral-style tower keeps of its padded images and its merger's windows
        (``adapters/patch_grids.py``), the real frames of an Idefics3-style model
        (``adapters/frames.py``), the image and audio tokens of a Phi-4-multimodal-style one
        (``adapters/crops.py``, ``adapters/audio.py``), where the model has them."""
        pieces = [piece for piece in (self.grids, self.frames, self.crops, self.audio) if piece is not None]
        if not pieces:
            return ()
        call = bind_call(self.model.forward, args, kwargs, self._signature)
        return tuple(size for piece in pieces for size in piece.derived_sizes(call))

    @contextlib.contextmanager
    def capturing(self, model: torch.nn.Module, sizes: dict[str, TracedSize]) -> Iterator[None]:
        owners = [m for m in model.modules() if any(callable(getattr(m, g, None)) for g in FEATURE_GETTERS)]
        with contextlib.ExitStack() as stack:
            for piece in (self.grids, self.frames, self.crops, self.audio):  # the audio's stand-ins wrap the crops'
                if piece is not None:
                    stack.enter_context(piece.capturing(model, sizes))
            if self.tiles is not None:  # entered first: the per-image pieces wrap its feature getter
                stack.enter_context(self.tiles.capturing(model))
            stack.enter_context(_accepting_precomputed(model, _vision_encoder(model)))
            stack.enter_context(packed_pieces(owners, FEATURE_GETTERS))
            stack.enter_context(_experts_as_batched_matmuls(model))
            yield


@contextlib.contextmanager
def _accepting_precomputed(model: torch.nn.Module, encoder: torch.nn.Module | None) -> Iterator[None]:
    """The metadata :meth:`TransformersAdapter.prepare` adds reaches the encoder while capturing.

    transformers routes ``image_cu_seqlens`` & co. to the encoder as ``cu_seqlens`` with the
    decorator ``accepts_precomputed_kwargs(modality)`` on the base model's ``get_<modality>_features``
    (the owner of the encoder, whose forward takes ``grid_thw``). A family that leaves the decorator
    out (Kimi-K2.5) hands the prefixed names to the encoder unread, so the encoder derives them again
    with loops over the grid's values, which a symbolic trace cannot run. For the capture, on the
    twin only (``capture/isolation.py``), that method gets the decorator; the model's own calls stay
    as they are and compute the same metadata with their loops: the same arithmetic."""
    patched: list[tuple[torch.nn.Module, str]] = []
    try:
        from transformers.utils.generic import accepts_precomputed_kwargs
    except ImportError:  # a transformers without the decorator: nothing routes precomputed metadata
        encoder = None
    if encoder is not None:
        decorated = accepts_precomputed_kwargs("image")(lambda: None).__code__
        for owner in (m for m in model.modules() if any(child is encoder for child in m.children())):
            for modality, getter in (("image", "get_image_features"), ("video", "get_video_features")):
                method = getattr(owner, getter, None)
                if callable(method) and not _wrapped_by(method, decorated):
                    owner.__dict__[getter] = accepts_precomputed_kwargs(modality)(method)
                    patched.append((owner, getter))
    try:
        yield
    finally:
        for owner, getter in patched:
            owner.__dict__.pop(getter, None)


def _wrapped_by(function: Any, code: Any) -> bool:
    """``function`` or one of the functions it wraps (``__wrapped__``) runs ``code``."""
    function = getattr(function, "__func__", function)
    while function is not None:
        if getattr(function, "__code__", None) is code:
            return True
        function = getattr(function, "__wrapped__", None)
    return False


@contextlib.contextmanager
def _experts_as_batched_matmuls(model: torch.nn.Module) -> Iterator[None]:
    """Mixture-of-experts layers traced through transformers' ``batched_mm`` experts implementation.

    The eager implementation loops over the experts a batch hits (``nonzero``, ``torch.where``: the
    number and sizes of the groups are data) and ``grouped_mm`` sorts tokens into data-sized groups;
    ``batched_mm`` multiplies every (token, chosen expert) pair by its expert's weights with one
    ``bmm`` of static shape. All three do the same multiply-adds, 2·top_k·tokens·(expert's
    weights): transformers' routers send every token to exactly ``top_k`` experts and drop none, so
    the count is exact for whichever implementation runs (the ``model`` MoE convention equals the
    ``actual`` one here). The router and shared experts are their own modules and counted as such.
    """
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_experts_implementation")}
    experts = [m for m in model.modules() if callable(getattr(m, "_apply_gate", None))]  # wrapped by use_experts_implementation
    saved = {key: config._experts_implementation for key, config in configs.items()} if experts else {}
    for key in saved:
        configs[key]._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        for key, value in saved.items():
            configs[key]._experts_implementation = value


@contextlib.contextmanager
def _naming(what: str, inputs: list[str]) -> Iterator[None]:
    """Turn a failure of the model's own metadata code into a MetadataError naming its inputs."""
    try:
        yield
    except CaptureError:
        raise
    except Exception as exc:
        raise MetadataError(
            f"{what} could not be derived from {', '.join(inputs)}: {type(exc).__name__}: {exc} "
            "(do the grids match the image/video tokens and pixel rows of the batch?)"
        ) from exc


def _in_cache(call: dict[str, Any], path: tuple) -> bool:
    """Whether the tensor at ``path`` is held by a transformers key-value cache."""
    from transformers.cache_utils import Cache

    return held_root(path) is not None and isinstance(call[path[0]], Cache)


def _cache_dims(rank: int) -> dict[int, str]:
    """A cache layer's keys and values are (batch, heads, past, head dim): the tokens before this call."""
    return {0: "batch", 2: "past"} if rank == 4 else {}


# known names that count independent items (sequences, images, videos): 1 in an example is one of
# many sizes; every other size of 1 (a decode step's one token, a mask's broadcast head dim) is static
COUNTS = frozenset({"batch", "images", "videos", "video_frames", "tiles", "frames", "crops", "clips", "audio_frames"})


def _known_dims(label: str, rank: int) -> dict[int, str]:
    """Readable names for the dims of the arguments every VLM family shares."""
    if label in TEXT_ARGUMENTS and rank >= 2:
        return {0: "batch", 1: "seq"}
    if label == "image_sizes" and rank == 2:
        return {0: "images"}
    if label == "position_ids":
        return {0: "batch", 1: "seq"} if rank == 2 else {1: "batch", 2: "seq"} if rank == 3 else {}
    for pixels, name in PIXEL_ARGUMENTS.items():
        if label == pixels and rank == 2:
            return {0: name}
        if label == pixels and rank == 4:
            return {0: "images" if pixels == "pixel_values" else "videos", 2: "height", 3: "width"}
    if label == "pixel_values_videos" and rank == 5:  # (videos, frames, channels, height, width)
        return {0: "videos", 1: "video_frames", 3: "height", 4: "width"}
    return {}


_STACKS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def _settings_of(encoder: torch.nn.Module) -> list[tuple[dict, str]]:
    """(namespace, name) of the plain settings a vision encoder's derived metadata can depend on:
    the public plain attributes of its config and of its modules outside repeated stacks (the patch
    embedding's ``patch_size``, the merger's ``spatial_merge_size``, ``window_size``,
    ``fullatt_block_indexes``; a stack's layers hold none of what the metadata reads)."""
    stacked = {id(m) for s in encoder.modules() if isinstance(s, _STACKS) for m in s.modules()}
    owners = [m for m in encoder.modules() if id(m) not in stacked]
    owners += [c for c in (getattr(encoder, "config", None),) if c is not None and hasattr(c, "__dict__")]
    return [
        (vars(owner), name) for owner in owners for name, value in vars(owner).items()
        if not name.startswith("_") and name != "training" and plain(value)
    ]


def _frozen(value: Any) -> Any:
    """A plain value as a hashable key (lists and dicts as tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    if isinstance(value, set):
        return frozenset(value)
    return value


def _precompute_encoder_inputs(encoder: torch.nn.Module, inputs: dict[str, Any]) -> None:
    """transformers' own precomputation of a ``grid_thw`` encoder's loop-built inputs, in place."""
    try:
        from transformers.exporters.utils import precompute_export_inputs
    except ImportError as exc:  # transformers < 5.x has no registry of precomputable vision inputs
        raise CaptureError(
            f"{type(encoder).__name__} builds its vision metadata with Python loops, and this transformers "
            "version has no transformers.exporters.utils.precompute_export_inputs to derive it from the batch "
            "(transformers >= 5 has)"
        ) from exc
    with torch.no_grad():
        precompute_export_inputs(encoder, inputs)
