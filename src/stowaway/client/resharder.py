"""``load()`` of a step saved by another number of ranks: each rank assembles its new shards from stored ranges.

In order: the sidecar opens the step's manifest and every saved rank's file
(or the slot that still holds it, on a restart in the same pod) and passes
the descriptors (``Link.open_files``), or, where its storage is a bucket
alone, stages the ranges the rank reads into the rank's own slots
(``staged_ranges``); the rank reads and checks
each file's header (its state tree and tensor offsets); it applies the rule
for what is not sharded; it plans, per DTensor, the regions of saved shards
its new shard is made of (``format.reshard``); it reads exactly those byte
ranges, checked piece by piece (``stored_files``), straight into the
destination where the rows land unchanged (FSDP's ``Shard(0)``); and it
rebuilds the state, on the caller's meshes or in the caller's tensors
(``into``).

The rule for plain tensors and other values, which are not sharded: they come
from one saved rank's file (this rank's number modulo the saved ranks), and
must be the same in every saved rank's file, as under DDP: the state trees
(every non-tensor value) are compared whole, and so are the bytes of plain
tensors of up to ``CHECKED_PLAIN_BYTES``. A difference (an RNG state or a data loader position
per rank) has no rule that would say which new rank gets which; it is refused
with ``WorldSizeChanged`` naming the value. Larger plain tensors (DDP's
parameters) are read from the one file unchecked: reading them from every
file would multiply the bytes read by the saved ranks.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stowaway.client.link import Link
from stowaway.client.rank_slots import RankSlots
from stowaway.client.staged_ranges import SlotWindows
from stowaway.client.stored_files import Descriptor, ReadCounter, StoredFile, read_manifest
from stowaway.errors import CheckpointCorrupt, SaveFailed, UnsupportedState, WorldSizeChanged
from stowaway.format import dtensors, dtypes, full_tensors, in_place, nodes, reshard
from stowaway.format import safetensors_header as st
from stowaway.format import tree as tree_mod
from stowaway.protocol import messages
from stowaway.storage import manifest

CHECKED_PLAIN_BYTES = 64 * 2**10

log = logging.getLogger("stowaway")


class Resharder:
    def __init__(self, job: str, rank: int, world_size: int, allow_pickle: bool, link: Link,
                 slots: RankSlots) -> None:
        self._job, self._rank, self._world_size = job, rank, world_size
        self._allow_pickle = allow_pickle
        self._link = link
        self._slots = slots

    def load(self, step: int, map_location: Any, meshes: tuple[Any, ...], into: Any,
             files_passed: bool) -> tuple[Any, int, bool]:
        """The state of ``step`` resharded onto this rank, the bytes it read from storage, and whether every
        saved rank's file came from a slot in shared memory rather than from storage.

        Slots the sidecar still holds are read first; where one does not
        match the manifest (a slot rewritten since, say), the whole step is
        read again from storage, ``into``'s tensors included. Where the
        sidecar passes no stored files (``files_passed`` false: a bucket
        alone), it also answers no mix of slots and files: unless every
        saved rank's slot is there, the ranges are staged from the bucket.
        """
        stored = ReadCounter()
        try:
            files = self._open(step, stored, from_memory=True)
        except SaveFailed as exc:
            if files_passed:
                raise
            log.info("rank %d: step %d is not whole in shared memory (%s); staging its ranges from the bucket",
                     self._rank, step, exc)
        else:
            in_memory = [isinstance(file.source, Descriptor) and file.source.base > 0 for file in files.values()]
            try:
                return self._read(step, files, map_location, meshes, into), stored.bytes, all(in_memory)
            except (CheckpointCorrupt, st.HeaderError) as exc:
                if not any(in_memory):
                    raise
                log.warning("rank %d: step %d in shared memory does not match its manifest (%s); reading it from "
                            "storage", self._rank, step, exc)
        stored = ReadCounter()
        files = self._open(step, stored, from_memory=False) if files_passed else self._staged(step, stored)
        return self._read(step, files, map_location, meshes, into), stored.bytes, False

    def _read(self, step: int, files: dict[int, StoredFile], map_location: Any, meshes: tuple[Any, ...],
              into: Any) -> Any:
        """The state assembled from ``files``, which are closed afterwards."""
        try:
            return self._assembled(step, files, map_location, meshes, into)
        finally:
            for file in files.values():
                file.close()

    def _manifest(self, step: int) -> manifest.Manifest:
        opened, fds = self._link.open_files(step, ())
        if opened.reason is not None:
            raise SaveFailed(opened.reason)
        try:
            return read_manifest(fds[0], self._where(step) / "manifest.json")
        except manifest.ManifestError as exc:
            raise CheckpointCorrupt(str(exc)) from exc
        finally:
            for fd in fds:
                os.close(fd)

    def _where(self, step: int) -> Path:
        return Path(f"step {step} of job {self._job}")

    def _open(self, step: int, stored: ReadCounter, from_memory: bool) -> dict[int, StoredFile]:
        """The saved ranks' files of ``step``, or the slots still holding them; reads of files count in ``stored``."""
        where = self._where(step)
        found = self._manifest(step)
        files: dict[int, StoredFile] = {}
        ranks = list(range(found.world_size))
        try:
            for first in range(0, len(ranks), messages.MAX_FILES_PER_OPEN):
                batch = tuple(ranks[first : first + messages.MAX_FILES_PER_OPEN])
                opened, fds = self._link.open_files(step, batch, from_memory)
                if opened.reason is not None:
                    raise SaveFailed(opened.reason)
                os.close(fds[0])
                bases = opened.payload_offsets or (0,) * len(batch)
                for rank, fd, base in zip(batch, fds[1:], bases, strict=True):
                    entry = found.file_for(rank)
                    if base:
                        files[rank] = StoredFile(Descriptor(fd, base), entry, where / f"slot of rank {rank}",
                                                 ReadCounter())
                    else:
                        files[rank] = StoredFile(Descriptor(fd), entry, where / entry.name, stored)
        except BaseException:
            for file in files.values():
                file.close()
            raise
        return files

    def _staged(self, step: int, stored: ReadCounter) -> dict[int, StoredFile]:
        """The saved ranks' files of ``step`` in a bucket alone, read through this rank's slots; the bytes staged
        count in ``stored``."""
        found = self._manifest(step)
        windows = SlotWindows(self._slots, step, stored, found.total_bytes // self._world_size)
        return {entry.rank: StoredFile(windows.file(entry.rank, entry.bytes), entry, self._where(step) / entry.name,
                                       ReadCounter())
                for entry in found.files}

    def _assembled(self, step: int, files: dict[int, StoredFile], map_location: Any, meshes: tuple[Any, ...],
                   into: Any) -> Any:
        saved = len(files)
        headers = _Headers(files)
        source = self._rank % saved
        tree = headers.tree(source)
        # Trees written alike are the same tree: only differing texts are decoded, to say where they differ.
        if any(headers.tree_text(rank) != headers.tree_text(source) for rank in files):
            differing = reshard.differences({rank: headers.tree(rank) for rank in files})
            if differing:
                raise WorldSizeChanged(self._unassignable(step, saved, "; ".join(differing)))
        dtensor_nodes, plain_names = reshard.split_tensors(tree)
        self._check_plain_equal(step, source, plain_names, headers, files)
        destinations = None
        if into is not None:
            metas = {name: torch.empty(spec.shape, dtype=tree_mod.TORCH_DTYPES[spec.dtype], device="meta")
                     for name, spec in headers.specs(source).items()}
            destinations = in_place.match(tree, metas, into, reshard=True)
        reader = _Reader(files, headers)
        tensors: dict[str, torch.Tensor] = {}
        builder = _Builder(tree.get(nodes.TREE_MESHES, []), meshes)
        filled_plain = {name: target for name, target in destinations.targets} if destinations else {}
        planned: dict[str, list[reshard.Region]] = {}
        positions = _Positions(self._rank)
        for node in dtensor_nodes:
            name = node[nodes.DTENSOR][nodes.TENSOR]
            given = destinations.resharded.get(name) if destinations else None
            try:
                if given:
                    placements = [dtensors.encode_placement(placement, "into") for placement in given[0].placements]
                    target, local = positions.target(given[0].device_mesh, placements), given[0].to_local()
                else:
                    mesh = builder.mesh(node)
                    target = positions.target(mesh, node[nodes.DTENSOR_PLACEMENTS])
                    local = torch.empty(reshard.new_local_shape(node[nodes.DTENSOR_SHAPE], target),
                                        dtype=tree_mod.TORCH_DTYPES[headers.item(source, name).spec.dtype])
                    builder.targets[name] = mesh
                # An optimizer's states repeat their parameter's layout: each layout is planned once. (repr, not
                # json.dumps: the same key, in a tenth of the time, for thousands of DTensors.)
                key = repr((node[nodes.DTENSOR_PLACEMENTS], node[nodes.DTENSOR_SHAPE], node[nodes.DTENSOR_MESH],
                            target.mesh_shape, target.coordinate, target.placements))
                if key not in planned:
                    planned[key] = reshard.regions(node, builder.saved, target, self._rank)
                regions = planned[key]
                reshard.check_shapes(node, regions, functools.partial(headers.shape, name=name))
            except reshard.Unmappable as exc:
                raise WorldSizeChanged(self._unmappable(step, saved, str(exc))) from exc
            reader.fill(name, local, regions)
            for other in (given or [])[1:]:
                with torch.no_grad():
                    other.to_local().copy_(local)
            tensors[name] = local if given else _moved(local, map_location)
        for name in plain_names:
            spec = headers.item(source, name).spec
            destination = filled_plain.get(name)
            plain = destination if destination is not None else torch.empty(spec.shape,
                                                                             dtype=tree_mod.TORCH_DTYPES[spec.dtype])
            rows = (0, spec.shape[0] if spec.shape else 1)
            if plain.numel():
                reader.fill(name, plain, [reshard.Region(source, spec.shape, rows, (), (), rows)])
            tensors[name] = plain if destination is not None else _moved(plain, map_location)
        replaced = destinations.by_node if destinations else None
        return tree_mod.unflatten(tree, tensors, builder, self._allow_pickle, replaced)

    def _check_plain_equal(self, step: int, source: int, plain_names: list[str], headers: _Headers,
                           files: dict[int, StoredFile]) -> None:
        """Refuse a small plain tensor that differs between saved files: per-rank state no rule can assign.

        The other files' bytes are compared unchecked (a read of the tensor's bytes only, where a checked read
        would read its pieces); where they differ, they are read checked, so that a corrupt file is told apart
        from state that differs per rank.
        """
        for name in plain_names:
            begin, end = headers.span(source, name)
            if end - begin > CHECKED_PLAIN_BYTES:
                continue
            expected = bytes(files[source].read(begin, end))
            for rank in sorted(files):
                if rank == source or headers.shape(rank, name) is None:
                    continue
                begin, end = headers.span(rank, name)
                if files[rank].peek(begin, end) == expected or bytes(files[rank].read(begin, end)) == expected:
                    continue
                raise WorldSizeChanged(self._unassignable(
                    step, len(files), f"the tensor stored as {name!r} differs between saved ranks {source} and {rank}"))

    def _unassignable(self, step: int, saved: int, what: str) -> str:
        return (f"rank {self._rank}: step {step} of job {self._job} was saved by {saved} ranks and this job has "
                f"{self._world_size}, and it cannot be resharded: {what}. State that is not a DTensor is restored "
                "from one saved rank's file only when every saved rank holds the same (as DDP keeps it); state "
                "that differs per rank (an RNG state, a data loader's position) has no rule that says which new "
                "rank gets which. Leave it out of the state you save, or make it the same on every rank, or read "
                "each saved rank's value with stowaway.read_checkpoint(path, rank=...) where the storage is "
                f"mounted; or run the job on {saved} ranks")

    def _unmappable(self, step: int, saved: int, what: str) -> str:
        return (f"rank {self._rank}: step {step} of job {self._job} was saved by {saved} ranks and this job has "
                f"{self._world_size}, and it cannot be resharded: {what}. Run the job on {saved} ranks, or save "
                "that tensor as Shard or Replicate (or as its full_tensor())")


class _Headers:
    """The saved ranks' checked headers. Every one is decoded, so that its state tree is compared with the
    others'; a tensor's entry is placed only when its bytes are read: placing each of thousands of entries in
    every saved rank's header cost a resharding rank more than it read, and most of them name shards it does
    not need."""

    def __init__(self, files: dict[int, StoredFile]) -> None:
        self._where = {rank: stored.where for rank, stored in files.items()}
        self._decoded = {rank: st.decode(stored.read(0, stored.header_bytes), stored.entry.bytes)
                         for rank, stored in files.items()}
        self._placed: dict[tuple[int, str], st.Placed | None] = {}

    def tree_text(self, rank: int) -> str:
        text = self._decoded[rank].metadata.get(nodes.METADATA_KEY)
        if text is None:
            raise st.HeaderError(f"{self._where[rank]} holds no Stowaway state tree")
        return text

    def tree(self, rank: int) -> dict[str, Any]:
        try:
            tree: dict[str, Any] = json.loads(self.tree_text(rank))
        except json.JSONDecodeError as exc:
            raise st.HeaderError(f"{self._where[rank]} holds no Stowaway state tree: {exc}") from exc
        return tree

    def shape(self, rank: int, name: str) -> tuple[int, ...] | None:
        """The shape of tensor ``name`` in the rank's file; None if the file has no such tensor."""
        item = self._placed_once(rank, name)
        return None if item is None else item.spec.shape

    def item(self, rank: int, name: str) -> st.Placed:
        """Tensor ``name`` of the rank's file, whose tree names it."""
        item = self._placed_once(rank, name)
        if item is None:
            raise st.HeaderError(f"{self._where[rank]}: its state tree names tensor {name!r}, its header does not")
        return item

    def span(self, rank: int, name: str) -> tuple[int, int]:
        """Where tensor ``name``'s bytes lie in the rank's file."""
        item, start = self.item(rank, name), len(self._decoded[rank].header)
        return start + item.begin, start + item.end

    def specs(self, rank: int) -> dict[str, st.TensorSpec]:
        return {name: self.item(rank, name).spec for name in self._decoded[rank].entries}

    def _placed_once(self, rank: int, name: str) -> st.Placed | None:
        key = (rank, name)
        if key not in self._placed:
            self._placed[key] = self._decoded[rank].placed(name)
        return self._placed[key]


class _Positions:
    """This rank's coordinate in each mesh, found once per mesh: torch builds ``DeviceMesh.mesh`` anew on each
    access, which cost a third of a resharding restore's time when it was asked once per DTensor."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        # By id; the mesh is kept, so that its id is not reused while this lives.
        self._found: dict[int, tuple[Any, tuple[tuple[int, ...], list[int]]]] = {}

    def target(self, mesh: Any, placements: list[dict[str, Any]]) -> reshard.Target:
        known = self._found.get(id(mesh))
        if known is None:
            ranks = mesh.mesh.tolist()
            position = full_tensors.mesh_position(ranks, self._rank)
            if position is None:
                raise reshard.Unmappable(f"rank {self._rank} is not in the mesh {ranks} passed to load()")
            known = self._found[id(mesh)] = (mesh, position)
        shape, coordinate = known[1]
        return reshard.Target(tuple(shape), list(coordinate), placements)


def _moved(local: torch.Tensor, map_location: Any) -> torch.Tensor:
    device = torch.device(map_location)
    return local if device == torch.device("cpu") else local.to(device)


class _Reader:
    """Fills new local tensors from the regions of saved shards that make them up."""

    def __init__(self, files: dict[int, StoredFile], headers: _Headers) -> None:
        self._files = files
        self._headers = headers

    def fill(self, name: str, local: torch.Tensor, regions: list[reshard.Region]) -> None:
        for region in regions:
            item = self._headers.item(region.rank, name)
            shape = item.spec.shape
            row_bytes = dtypes.ELEMENT_BYTES[item.spec.dtype] * math.prod(shape[1:])
            first = self._headers.span(region.rank, name)[0]
            begin, end = first + region.rows[0] * row_bytes, first + region.rows[1] * row_bytes
            stored = self._files[region.rank]
            if region.whole_rows is not None and local.device.type == "cpu" and local.is_contiguous():
                rows = local.reshape(1) if not shape else local[region.whole_rows[0] : region.whole_rows[1]]
                # Detached: the bytes of a Parameter that requires grad are written as any tensor's.
                stored.read(begin, end, memoryview(rows.detach().reshape(-1).view(torch.uint8).numpy().data))
                continue
            raw = torch.frombuffer(stored.read(begin, end), dtype=torch.uint8)
            typed = raw.view(tree_mod.TORCH_DTYPES[item.spec.dtype])
            block = typed.reshape(region.rows[1] - region.rows[0], *shape[1:])
            if not region.source:  # a whole plain tensor, into a destination the bytes cannot be read into
                with torch.no_grad():
                    local.copy_(block.reshape(local.shape))
                continue
            with torch.no_grad():
                local[full_tensors.cross_index(region.target)] = block[full_tensors.cross_index(region.source)].to(
                    local.device)


class _Builder:
    """Rebuilds each resharded DTensor on the caller's mesh, with the saved placements."""

    def __init__(self, saved: list[dict[str, Any]], given: tuple[Any, ...]) -> None:
        self.saved = saved
        self._given = given
        self.targets: dict[str, Any] = {}

    def mesh(self, node: nodes.Node) -> Any:
        """The mesh passed to ``load`` that stands for the DTensor's saved one: the same names, or dimensions."""
        saved = self.saved[node[nodes.DTENSOR_MESH]]
        names = saved[nodes.MESH_NAMES]
        dims = np.array(saved[nodes.MESH_RANKS]).ndim
        for mesh in self._given:
            given_names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
            if (given_names == names if names else mesh.mesh.ndim == dims) and mesh.mesh.ndim == dims:
                return mesh
        name = node[nodes.DTENSOR][nodes.TENSOR]
        shown = f" named {tuple(names)}" if names else ""
        raise UnsupportedState(
            f"the DTensor stored as {name!r} was saved on a {dims}-dimensional {saved[nodes.MESH_DEVICE]} mesh"
            f"{shown} by another number of ranks: pass load(device_mesh=...) this job's mesh of that shape (for "
            "FSDP2, the mesh given to fully_shard), or load(into=...) the state whose DTensors it fills"
        )

    def rebuild(self, node: nodes.Node, local: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        name = node[nodes.DTENSOR][nodes.TENSOR]
        dtensor = DTensor.from_local(
            local, self.targets[name], [dtensors.decode_placement(item) for item in node[nodes.DTENSOR_PLACEMENTS]],
            run_check=False, shape=torch.Size(node[nodes.DTENSOR_SHAPE]), stride=tuple(node[nodes.DTENSOR_STRIDE]),
        )
        if nodes.DTENSOR_PARAMETER in node:
            return torch.nn.Parameter(dtensor, requires_grad=bool(node[nodes.DTENSOR_PARAMETER]))
        return dtensor
