"""Who may use the sidecar: a process of an allowed uid, or one in the socket's group.

The socket is 0660 in a directory of its group (in a pod, the fsGroup that
kubelet adds to every container), so members of that group can already
open it and the slot files: refusing them would only break trainers whose
uid the webhook cannot know (an image's non-root USER). The check still
refuses everyone else, should the socket end up more open than its group.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

_PEERCRED = struct.Struct("3i")
# Linux 4.13+, not named by Python's socket module; 59 on x86-64 and arm64 alike.
_SO_PEERGROUPS = 59
# CPython's getsockopt returns at most 1024 bytes: 256 supplementary groups.
_MAX_GROUP_BYTES = 1024


@dataclass(frozen=True)
class Peer:
    uid: int
    # The primary group and every supplementary group.
    groups: frozenset[int]


def credentials(sock: socket.socket) -> Peer:
    _, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _MAX_GROUP_BYTES)
    except OSError:
        # More groups than fit, or a kernel without the option: the uid alone decides.
        raw = b""
    return Peer(uid, frozenset({gid, *struct.unpack(f"{len(raw) // 4}I", raw)}))


def refusal(peer: Peer, allowed_uids: frozenset[int], socket_group: int) -> str | None:
    """Why ``peer`` may not use the sidecar, or None when it may."""
    if peer.uid in allowed_uids or socket_group in peer.groups:
        return None
    return (f"uid {peer.uid} may not use this sidecar: it is not one of the allowed uids {sorted(allowed_uids)} "
            f"and not in group {socket_group}, which owns the socket; run the trainer in that group "
            "(in Kubernetes, the pod's fsGroup) or start the sidecar with --allow-uid")
