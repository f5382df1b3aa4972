"""Copy a flattened state dict into a payload buffer, and read one back.

``encode`` plans the layout once; ``write_into`` is the hot path of ``save``:
one ``copy_`` per tensor into a view of the slot, nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from stowaway.format import dtensors, dtypes, in_place, nodes
from stowaway.format import safetensors_header as st
from stowaway.format import template as template_mod
from stowaway.format import tree as tree_mod


@dataclass(frozen=True)
class Encoded:
    layout: st.Layout
    # The non-empty tensors, in layout order: what ``targets`` returns views for.
    sources: list[torch.Tensor]
    # CUDA devices holding some of the sources: their copies are asynchronous and must be fenced.
    cuda_devices: frozenset[torch.device] = frozenset()

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes


class Encoder:
    """Encodes states, reusing the previous save's work while the state keeps its structure.

    A training state keeps its structure from one save to the next; only
    scalars such as step counters change. Flattening, planning and
    serializing cost Python time for every tensor, which ``save`` would
    otherwise block on every time: the layout plan is kept
    while names, dtypes and shapes stay the same, and the tree while the
    whole structure does (``format.template``).
    """

    def __init__(self) -> None:
        self._signature: list[tuple[str, torch.dtype, torch.Size, torch.device]] = []
        self._plan: st.Plan | None = None
        self._cuda_devices: frozenset[torch.device] = frozenset()
        self._template: template_mod.Template | None = None
        # Walk-order positions of the non-empty tensors, in layout order.
        self._source_positions: list[int] = []

    def encode(self, state: Any, allow_pickle: bool = False) -> Encoded:
        # Encoding reads tensors and never differentiates; autograd would wrap DTensor.to_local in a function.
        with torch.no_grad():
            return self._encode(state, allow_pickle)

    def _encode(self, state: Any, allow_pickle: bool) -> Encoded:
        walked = template_mod.walk(state)
        if walked is not None and self._template is not None and self._template.fits(walked):
            escaped_tree = self._template.render(walked.scalars)
            tensors = walked.tensors
            sources = [tensors[position] for position in self._source_positions]
        else:
            escaped_tree, sources = self._encode_afresh(state, walked, allow_pickle)
        assert self._plan is not None
        metadata_json = '{"format":"pt","' + nodes.METADATA_KEY + '":"' + escaped_tree + '"}'
        return Encoded(self._plan.layout(metadata_json), sources, self._cuda_devices)

    def _encode_afresh(self, state: Any, walked: template_mod.Walk | None,
                       allow_pickle: bool) -> tuple[str, list[torch.Tensor]]:
        flat = tree_mod.flatten(state, allow_pickle)
        # Compared element by element in C: names, dtypes, torch.Size and devices are all built-in comparisons.
        signature = [(name, tensor.dtype, tensor.shape, tensor.device) for name, tensor in flat.tensors.items()]
        if self._plan is None or signature != self._signature:
            specs = [st.TensorSpec(name, tree_mod.SAFETENSORS_NAMES[dtype], tuple(shape))
                     for name, dtype, shape, _ in signature]
            self._signature, self._plan = signature, st.plan(specs)
            self._cuda_devices = frozenset(device for *_, device in signature if device.type == "cuda")
        # The tree is built by flatten() and has no cycles, so the encoder need not look for any.
        escaped_tree = template_mod.escape(json.dumps(flat.tree, separators=(",", ":"), check_circular=False))
        layout_names = [item.spec.name for item in self._plan.tensors if item.begin != item.end]
        first_position: dict[str, int] = {}
        for position, name in enumerate(flat.occurrences):
            first_position.setdefault(name, position)
        self._source_positions = [first_position[name] for name in layout_names]
        self._template = template_mod.Template.build(walked, flat, escaped_tree)
        return escaped_tree, [flat.tensors[name] for name in layout_names]


def targets(layout: st.Layout, payload: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``payload`` where each non-empty tensor of ``layout`` goes, in layout order."""
    return _views(payload, layout, [item for item in layout.tensors if item.begin != item.end])


def write_into(encoded: Encoded, payload: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Fill ``payload`` (a uint8 tensor over the slot) with the file image; ``views`` come from ``targets``."""
    write_header(encoded, payload)
    with torch.no_grad():
        if not encoded.cuda_devices:
            if views:  # _foreach_copy_ refuses an empty list: a state of scalars only has no tensor bytes
                torch._foreach_copy_(views, encoded.sources)
            return
        for view, source in zip(views, encoded.sources, strict=True):
            view.copy_(source, non_blocking=source.device.type == "cuda")
        # The fence: save() returns once the bytes are in the slot, so the caller may then change its tensors.
        for device in encoded.cuda_devices:
            torch.cuda.current_stream(device).synchronize()


def write_header(encoded: Encoded, payload: torch.Tensor) -> None:
    """The safetensors header at the start of ``payload``: the part of the image that is not the state's."""
    header = encoded.layout.header
    payload[: len(header)].numpy()[:] = memoryview(header)


def enqueue_device_copies(encoded: Encoded, views: list[torch.Tensor],
                          streams: dict[torch.device, Any]) -> dict[torch.device, Any]:
    """Queue each device source's copy on its device's side stream in ``streams``; an event per device ends them.

    The side stream first waits for the work already queued on the current
    stream, which produced the values, and each source is recorded on it, so
    that the caching allocator does not hand its memory to a later tensor
    before the copy has read it. Nothing here waits on the host.
    """
    events: dict[torch.device, Any] = {}
    with torch.no_grad():
        for device in encoded.cuda_devices:
            streams[device].wait_stream(torch.cuda.current_stream(device))
        for view, source in zip(views, encoded.sources, strict=True):
            if source.device.type == "cuda":
                side = streams[source.device]
                with torch.cuda.stream(side):
                    view.copy_(source, non_blocking=True)
                source.record_stream(side)
        for device in encoded.cuda_devices:
            events[device] = streams[device].record_event()
    return events


def copy_host_sources(encoded: Encoded, views: list[torch.Tensor]) -> None:
    """Copy the sources that live in host memory (all of them, without a GPU) into their ``views``."""
    pairs = [(view, source) for view, source in zip(views, encoded.sources, strict=True)
             if source.device.type != "cuda"]
    if pairs:  # _foreach_copy_ refuses an empty list
        with torch.no_grad():
            torch._foreach_copy_([view for view, _ in pairs], [source for _, source in pairs])


def read_from(payload: torch.Tensor, nbytes: int, map_location: Any, allow_pickle: bool = False,
              meshes: tuple[Any, ...] = (), into: Any = None) -> Any:
    """Rebuild the state dict from a payload, copying every tensor out of the buffer; DTensors go onto ``meshes``.

    With ``into``, the tensors it holds receive their stored bytes and come
    back in place of new ones (``format.in_place``).
    """
    tree, views = parsed(payload, nbytes)
    destinations = None
    if into is not None:
        destinations = in_place.match(tree, views, into)
        destinations.fill(views)
    return rebuilt(tree, views, map_location, dtensors.Rebuilder(tree, meshes), allow_pickle, destinations)


def rebuilt(tree: dict[str, Any], views: dict[str, torch.Tensor], map_location: Any,
            dtensor_builder: tree_mod.DTensorBuilder, allow_pickle: bool = False,
            destinations: in_place.Destinations | None = None) -> Any:
    """The state of a parsed payload, each tensor a copy of its view but where ``destinations`` were filled.

    The views point into a buffer that is reused (a slot) or dropped (a file
    read): what comes back must not, so every tensor is copied out; a
    destination already filled holds the bytes and is returned instead.
    """
    if destinations is None:
        return tree_mod.unflatten(tree, _copies(views, map_location), dtensor_builder, allow_pickle)
    filled = destinations.filled
    tensors = _CopiedOnDemand(views, map_location)
    tensors.update(_copies({name: view for name, view in views.items() if name not in filled}, map_location))
    return tree_mod.unflatten(tree, tensors, dtensor_builder, allow_pickle, destinations.by_node)


def _copies(views: dict[str, torch.Tensor], map_location: Any) -> dict[str, torch.Tensor]:
    if torch.device(map_location) == torch.device("cpu"):
        return {name: view.clone() for name, view in views.items()}
    return {name: view.to(map_location, copy=True) for name, view in views.items()}


class _CopiedOnDemand(dict[str, torch.Tensor]):
    """Copies of a payload's tensors by name; one not copied up front is copied when first asked for.

    ``into`` fills the caller's tensors instead of copying, but a
    stored tensor may also appear where ``into`` has none (one half of a
    tie): that one is copied when the tree reaches it.
    """

    def __init__(self, views: dict[str, torch.Tensor], map_location: Any) -> None:
        super().__init__()
        self._views = views
        self._map_location = map_location

    def __missing__(self, name: str) -> torch.Tensor:
        copy = self[name] = _copies({name: self._views[name]}, self._map_location)[name]
        return copy


def parsed(payload: torch.Tensor, nbytes: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A payload's state tree, and a view of the payload for each of its tensors by name."""
    layout, tree = parsed_header(payload.numpy().data, nbytes)
    views = _views(payload, layout, layout.tensors)
    return tree, {item.spec.name: view for item, view in zip(layout.tensors, views, strict=True)}


def parsed_header(raw: memoryview, nbytes: int) -> tuple[st.Layout, dict[str, Any]]:
    """The layout and the state tree of the header at the start of ``raw`` (of a payload of ``nbytes``)."""
    layout, metadata = st.parse(raw, nbytes)
    try:
        return layout, json.loads(metadata[nodes.METADATA_KEY])
    except (KeyError, json.JSONDecodeError) as exc:
        raise st.HeaderError(f"payload carries no Stowaway state tree: {exc}") from exc


def _views(payload: torch.Tensor, layout: st.Layout, items: list[st.Placed]) -> list[torch.Tensor]:
    """Typed views of ``payload`` for ``items``, one ``as_strided`` each.

    Slicing, then viewing as the dtype, then as the shape costs three tensor
    constructions per tensor, which a state of thousands of tensors pays on
    every save and restore. Every offset is a multiple of its
    element size (``plan`` places larger elements first); a header read back
    that breaks this is refused here.
    """
    typed: dict[str, torch.Tensor] = {}
    # Optimizer states repeat each parameter's shape several times.
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}
    views = []
    data_start = layout.data_start
    for item in items:
        spec = item.spec
        size = dtypes.ELEMENT_BYTES[spec.dtype]
        whole = typed.get(spec.dtype)
        if whole is None:
            whole = payload[: payload.numel() // size * size].view(tree_mod.TORCH_DTYPES[spec.dtype])
            typed[spec.dtype] = whole
        offset, misaligned = divmod(data_start + item.begin, size)
        if misaligned:
            raise st.HeaderError(f"tensor {spec.name!r} starts at an offset that is not a multiple of its element size")
        stride = strides.get(spec.shape)
        if stride is None:
            stride = strides[spec.shape] = _contiguous_strides(spec.shape)
        views.append(whole.as_strided(spec.shape, stride, offset))
    return views


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))
