"""Message types, their fields, and validation.

Each message is a frozen dataclass whose fields are the JSON object's keys; its
``type`` key is the class's ``TYPE``. The field annotations are the schema:
constructing a message checks every field against its annotation (and a hello
against the rules for names and ranks), whether the values come from the wire
through ``decode`` or from code, so handlers never deal with a missing key or
a string where a number belongs, and a bad message becomes one clear error
frame instead of an exception deep inside the sidecar. ``encode`` gives back
the JSON object, key for key as ``decode`` reads it.

A field with a default is optional: added to a message type after its
version, it MAY be absent from a frame (it then takes its default), and
``encode`` leaves it out while it is None, so a peer that predates it reads
the same frames as before, and ignores it when present.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, overload

PROTOCOL_VERSION = 4

# \Z, not $: "$" also matches before a trailing newline, which would let "job\n" name a directory.
JOB_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
NODE_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")
MAX_SLOTS_PER_RANK = 64
# A pod's pooled spare slots, shared by its ranks: spare k is slot index POOLED_SLOT_BASE + k on every rank's
# connection, above the rank's own slots (docs/operator.md, "Pooled spare slots").
POOLED_SLOT_BASE = MAX_SLOTS_PER_RANK
MAX_POOLED_SPARES = 8
# Descriptors one ``opened`` passes at most: the manifest and this many rank files. The kernel passes at
# most 253 descriptors in one message (SCM_MAX_FD); a client asks for more files in several ``open``s.
MAX_FILES_PER_OPEN = 252
MAX_WORLD_SIZE = 1 << 20
# Steps, generations and sizes are stored as 64-bit integers (slot header, file names); a value outside
# this range can only come from a broken or hostile peer.
MAX_INT64 = 2**63 - 1


class MessageError(ValueError):
    """A decoded frame is not a valid message of the protocol."""


class _Int64:
    def check(self, where: str, value: int) -> None:
        if not 0 <= value <= MAX_INT64:
            raise MessageError(f"{where} must be between 0 and {MAX_INT64}, got {value}")


class _SlotIndex:
    def check(self, where: str, value: int) -> None:
        if not 0 <= value < POOLED_SLOT_BASE + MAX_POOLED_SPARES:
            raise MessageError(f"slot index {value} is outside 0..{POOLED_SLOT_BASE + MAX_POOLED_SPARES - 1}")


# ``X | None`` is a types.UnionType, but ``Annotated[...] | None`` a typing.Union.
_UNIONS = (types.UnionType, typing.Union)

# A step, generation, size or pid: what the slot header and the file names store.
Int64 = Annotated[int, _Int64()]
# A slot of one rank (slot files are named with two digits, and a rank has at most this many), or a pooled spare.
SlotIndex = Annotated[int, _SlotIndex()]
# Where load() found the step it restored: a slot that still held it, or the storage (staged into a slot).
RestoreSource = Literal["memory", "storage"]


@dataclass(frozen=True)
class Record:
    """Fields checked and normalised from their annotations at construction (JSON lists become tuples)."""

    def __post_init__(self) -> None:
        for name, hint in _hints(type(self)).items():
            object.__setattr__(self, name, _typed(hint, getattr(self, name), f"{self._label()}.{name}"))

    def _label(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Message(Record):
    """One JSON object on the wire; ``TYPE`` is its ``type`` key."""

    TYPE: ClassVar[str]

    def _label(self) -> str:
        return self.TYPE


class ToSidecar(Message):
    """A message a rank sends to its sidecar."""


class ToClient(Message):
    """A message the sidecar sends to a rank."""


# Client -> sidecar.


@dataclass(frozen=True)
class Hello(ToSidecar):
    TYPE: ClassVar[str] = "hello"
    protocol: int
    job: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node: str
    pid: Int64

    def __post_init__(self) -> None:
        """Check what the field types cannot: version, names, and rank arithmetic."""
        super().__post_init__()
        if self.protocol != PROTOCOL_VERSION:
            raise MessageError(
                f"protocol version {self.protocol} is not supported; this sidecar speaks "
                f"version {PROTOCOL_VERSION}: use the same Stowaway release for client and sidecar"
            )
        if not JOB_NAME.match(self.job):
            raise MessageError(
                f"job name {self.job!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if not NODE_NAME.match(self.node):
            raise MessageError(f"node name {self.node!r} is invalid")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE or not 0 <= self.rank < self.world_size:
            raise MessageError(f"rank {self.rank} is not within world size {self.world_size}")
        if not 1 <= self.local_world_size <= self.world_size or not 0 <= self.local_rank < self.local_world_size:
            raise MessageError(
                f"local rank {self.local_rank} is not within local world size {self.local_world_size}"
            )


@dataclass(frozen=True)
class Register(ToSidecar):
    TYPE: ClassVar[str] = "register"
    slot: SlotIndex
    capacity: Int64


@dataclass(frozen=True)
class Persist(ToSidecar):
    TYPE: ClassVar[str] = "persist"
    run: str
    step: Int64
    slot: SlotIndex
    generation: Int64
    nbytes: Int64
    blocking_seconds: float
    slot_wait_seconds: float
    # Optional, for save(overlap=True) only: from save() to the end of its copy, and how long the training loop
    # waited on the host for that copy (a guarded change, or the next save) until it ended.
    staging_seconds: float | None = None
    stall_seconds: float | None = None

    @property
    def hidden_seconds(self) -> float | None:
        """Copy time of an overlapped save the training loop did not wait for; None for a blocking save.

        The staging time less what ``save()`` blocked for (before the copy
        ran behind the loop's back) and less the stall (when the loop waited
        for it): the rank and the sidecar both count it this way.
        """
        if self.staging_seconds is None:
            return None
        return max(0.0, self.staging_seconds - self.blocking_seconds - (self.stall_seconds or 0.0))


@dataclass(frozen=True)
class Query(ToSidecar):
    TYPE: ClassVar[str] = "query"


@dataclass(frozen=True)
class Stage(ToSidecar):
    """Hand a slot to the sidecar to fill from storage: with the rank's own file of ``step``, published as that
    step; or, with ``rank``, ``begin`` and ``nbytes``, with that range of saved rank ``rank``'s file, left
    unpublished (a resharding rank reads it from the payload, where the storage passes no files)."""

    TYPE: ClassVar[str] = "stage"
    step: Int64
    slot: SlotIndex
    rank: int | None = None
    begin: Int64 | None = None
    nbytes: Int64 | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        given = [value is not None for value in (self.rank, self.begin, self.nbytes)]
        if any(given) and not all(given):
            raise MessageError("stage of a range needs rank, begin and nbytes together")
        if self.rank is not None and not 0 <= self.rank < MAX_WORLD_SIZE:
            raise MessageError(f"stage names rank {self.rank}; ranks are between 0 and {MAX_WORLD_SIZE - 1}")

    @property
    def span(self) -> tuple[int, int, int] | None:
        """(rank, begin, nbytes) of a range, or None for the rank's own file."""
        if self.rank is None or self.begin is None or self.nbytes is None:
            return None
        return self.rank, self.begin, self.nbytes


@dataclass(frozen=True)
class Open(ToSidecar):
    """Ask for read-only descriptors of a committed step's manifest and of the files of the saved ``ranks``.

    The storage is mounted only into the sidecar; a rank that reshards a
    step reads the byte ranges it needs of other ranks' files through
    descriptors the sidecar opened for it, passed with ``SCM_RIGHTS``.
    """

    TYPE: ClassVar[str] = "open"
    step: Int64
    ranks: tuple[int, ...]
    # Where a slot in the sidecar's shared memory still holds a rank's file of the step, pass the slot instead:
    # a restart on the same pod with fewer or more ranks then reads nothing from storage.
    from_memory: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.ranks) > MAX_FILES_PER_OPEN or any(not 0 <= rank < MAX_WORLD_SIZE for rank in self.ranks):
            raise MessageError(f"open names {len(self.ranks)} ranks; at most {MAX_FILES_PER_OPEN}, each "
                               f"between 0 and {MAX_WORLD_SIZE - 1}")


@dataclass(frozen=True)
class Restored(ToSidecar):
    """``load()`` restored ``step`` on this rank, taking ``seconds`` in all: a report, which gets no answer.

    Only the rank knows a restore from memory happened (it reads its slot
    without asking), so it tells the sidecar, whose log and metrics are what
    an operator can see.
    """

    TYPE: ClassVar[str] = "restored"
    step: Int64
    source: RestoreSource
    seconds: float


# Sidecar -> client.


@dataclass(frozen=True)
class Welcome(ToClient):
    TYPE: ClassVar[str] = "welcome"
    protocol: int
    node: str
    busy: tuple[SlotIndex, ...]
    shm_dir: str


@dataclass(frozen=True)
class Registered(ToClient):
    TYPE: ClassVar[str] = "registered"
    slot: SlotIndex


@dataclass(frozen=True)
class Released(ToClient):
    TYPE: ClassVar[str] = "released"
    slot: SlotIndex
    step: Int64
    generation: Int64


@dataclass(frozen=True)
class Persisted(ToClient):
    TYPE: ClassVar[str] = "persisted"
    step: Int64


@dataclass(frozen=True)
class Committed(ToClient):
    TYPE: ClassVar[str] = "committed"
    step: Int64


@dataclass(frozen=True)
class Failed(ToClient):
    """A persist or a stage failed (``slot`` returned), or the whole step cannot commit (``slot`` None)."""

    TYPE: ClassVar[str] = "failed"
    step: Int64
    slot: SlotIndex | None
    reason: str


@dataclass(frozen=True)
class StoredStep(Record):
    step: Int64
    nbytes: Int64


@dataclass(frozen=True)
class StepInSlot(Record):
    step: Int64
    slot: SlotIndex


@dataclass(frozen=True)
class OtherWorldStep(Record):
    step: Int64
    world_size: int


@dataclass(frozen=True)
class Inventory(ToClient):
    TYPE: ClassVar[str] = "inventory"
    committed: tuple[StoredStep, ...]
    memory: tuple[StepInSlot, ...]
    other_world: tuple[OtherWorldStep, ...]
    # False where the sidecar's storage is a bucket alone: it passes no stored files (``open``), and stages a
    # rank's own file into its slot instead.
    files_passed: bool = True


@dataclass(frozen=True)
class Staged(ToClient):
    TYPE: ClassVar[str] = "staged"
    step: Int64
    slot: SlotIndex
    generation: Int64
    nbytes: Int64


@dataclass(frozen=True)
class Opened(ToClient):
    """The answer to ``open``: with ``reason`` null, the frame carries ``1 + len(ranks)`` descriptors (the
    manifest, then each rank's file in the order of ``ranks``); else none, and ``reason`` says why."""

    TYPE: ClassVar[str] = "opened"
    step: Int64
    ranks: tuple[int, ...]
    reason: str | None
    # Per rank file, where its bytes begin in the descriptor: 0 for a stored file, the slot header's size for
    # a slot passed instead (``from_memory``); absent means every descriptor is a stored file.
    payload_offsets: tuple[Int64, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.payload_offsets is not None and len(self.payload_offsets) != len(self.ranks):
            raise MessageError(f"opened gives {len(self.payload_offsets)} payload offsets for {len(self.ranks)} ranks")

    @property
    def descriptors(self) -> int:
        return 0 if self.reason is not None else 1 + len(self.ranks)


@dataclass(frozen=True)
class Error(ToClient):
    """The sidecar ends the connection for a protocol error (or refuses the peer) and says why."""

    TYPE: ClassVar[str] = "error"
    reason: str


class Direction(enum.Enum):
    TO_SIDECAR = "client to sidecar"
    TO_CLIENT = "sidecar to client"

    @property
    def kinds(self) -> Mapping[str, type[Message]]:
        """Every message type that travels this way, by its ``type``."""
        return _KINDS[self]


_KINDS: dict[Direction, Mapping[str, type[Message]]] = {
    Direction.TO_SIDECAR: {kind.TYPE: kind for kind in (Hello, Register, Persist, Query, Stage, Open, Restored)},
    Direction.TO_CLIENT: {
        kind.TYPE: kind
        for kind in (Welcome, Registered, Released, Persisted, Committed, Failed, Inventory, Staged, Opened,
                     Error)
    },
}


@overload
def decode(frame: Mapping[str, Any], direction: Literal[Direction.TO_SIDECAR]) -> ToSidecar: ...


@overload
def decode(frame: Mapping[str, Any], direction: Literal[Direction.TO_CLIENT]) -> ToClient: ...


def decode(frame: Mapping[str, Any], direction: Direction) -> Message:
    """The message a frame's JSON object holds, checked field by field; ``MessageError`` says what is wrong.

    Keys the message type does not have are ignored.
    """
    kinds = direction.kinds
    kind = frame.get("type")
    if not isinstance(kind, str) or kind not in kinds:
        raise MessageError(f"unknown message type {kind!r}; expected one of {sorted(kinds)}")
    cls = kinds[kind]
    values: dict[str, object] = {}
    for name, hint in _hints(cls).items():
        if name not in frame:
            if name in _optional(cls):
                continue
            raise MessageError(f"{kind} message lacks field {name!r}")
        values[name] = _typed(hint, frame[name], f"{kind}.{name}")
    return cls(**values)


def encode(message: Message) -> dict[str, Any]:
    """The JSON object of ``message``: ``type`` first, then its fields in their declared order."""
    return {"type": message.TYPE, **_plain(message)}


def _plain(record: Record) -> dict[str, Any]:
    optional = _optional(type(record))
    return {name: _json(value) for name in _hints(type(record))
            if (value := getattr(record, name)) is not None or name not in optional}


def _json(value: object) -> object:
    if isinstance(value, tuple):
        return [_json(item) for item in value]
    if isinstance(value, Record):
        return _plain(value)
    return value


def _hints(cls: type[Record]) -> dict[str, object]:
    """Field name -> annotation (constraints included), in declared order: the schema of ``cls``."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        schema = _SCHEMAS[cls] = {field.name: hints[field.name] for field in dataclasses.fields(cls)}
    return schema


_SCHEMAS: dict[type[Record], dict[str, object]] = {}


def _optional(cls: type[Record]) -> frozenset[str]:
    """The fields of ``cls`` that have a default: a frame may lack them, and None ones are not encoded."""
    optional = _OPTIONAL.get(cls)
    if optional is None:
        optional = _OPTIONAL[cls] = frozenset(
            field.name for field in dataclasses.fields(cls) if field.default is not dataclasses.MISSING
        )
    return optional


_OPTIONAL: dict[type[Record], frozenset[str]] = {}


def _typed(hint: object, value: object, where: str) -> object:
    """``value`` checked against the annotation ``hint``; JSON lists and objects become tuples and records."""
    if value.__class__ is bool and hint is not bool and bool not in typing.get_args(hint):
        raise MessageError(f"{where} must be {_describe(hint)}, got a boolean")
    if typing.get_origin(hint) is Annotated:
        base, *constraints = typing.get_args(hint)
        checked = _typed(base, value, where)
        for constraint in constraints:
            constraint.check(where, checked)
        return checked
    if typing.get_origin(hint) in _UNIONS:
        if value is None and type(None) in typing.get_args(hint):
            return None
        (base,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if not _matches(base, value):
            raise MessageError(f"{where} must be {_describe(hint)}, got {type(value).__name__}")
        return _typed(base, value, where)
    if typing.get_origin(hint) is Literal:
        # Compared by type too, so that a literal 1 would not take 1.0 (1 == 1.0 in Python, not on the wire).
        if not any(type(value) is type(allowed) and value == allowed for allowed in typing.get_args(hint)):
            raise MessageError(f"{where} must be {_describe(hint)}, got {reprlib.repr(value)}")
        return value
    if not _matches(hint, value):
        raise MessageError(f"{where} must be {_describe(hint)}, got {type(value).__name__}")
    if typing.get_origin(hint) is tuple:
        item_hint = typing.get_args(hint)[0]
        assert isinstance(value, list | tuple)
        return tuple(_typed(item_hint, item, f"{where}[{index}]") for index, item in enumerate(value))
    if isinstance(hint, type) and issubclass(hint, Record) and isinstance(value, dict):
        return _record(hint, value, where)
    return value


def _record(cls: type[Record], value: dict[str, Any], where: str) -> Record:
    fields: dict[str, object] = {}
    for name, hint in _hints(cls).items():
        if name not in value:
            if name in _optional(cls):
                continue
            raise MessageError(f"{where} lacks field {name!r}")
        fields[name] = _typed(hint, value[name], f"{where}.{name}")
    return cls(**fields)


def _matches(hint: object, value: object) -> bool:
    """Whether ``value`` has the JSON type of ``hint`` (a float field takes an integer too)."""
    if typing.get_origin(hint) is Annotated:
        return _matches(typing.get_args(hint)[0], value)
    if typing.get_origin(hint) is tuple:
        return isinstance(value, list | tuple)
    if hint is float:
        return isinstance(value, int | float)
    if isinstance(hint, type) and issubclass(hint, Record):
        return isinstance(value, dict | hint)
    assert isinstance(hint, type), hint
    return isinstance(value, hint)


def _describe(hint: object) -> str:
    if typing.get_origin(hint) is Annotated:
        return _describe(typing.get_args(hint)[0])
    if typing.get_origin(hint) in _UNIONS:
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return "list"
    if typing.get_origin(hint) is Literal:
        return " or ".join(repr(allowed) for allowed in typing.get_args(hint))
    if hint is float:
        return "int or float"
    if isinstance(hint, type) and issubclass(hint, Record):
        return "dict"
    assert isinstance(hint, type), hint
    return hint.__name__
