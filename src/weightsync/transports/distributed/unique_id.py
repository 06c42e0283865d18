"""Reading the NCCL unique id a vLLM trainer puts in its store, without unpickling it.

vLLM's ``StatelessProcessGroup.broadcast_obj`` (``vllm/distributed/utils.py``) passes rank 0's
``ncclUniqueId`` to the other ranks as ``pickle.dumps(obj)`` under the store key
``broadcast_from/0/0``; ``PyNcclCommunicator.__init__`` (``vllm/distributed/device_communicators/
pynccl.py``) is its one caller before ``ncclCommInitRank``.  A general unpickler would run
whatever that store value names, and the store is reachable by anyone who can reach the
trainer's port.  :func:`read_nccl_unique_id` accepts exactly the pickle of that one value, a
``ctypes.Structure`` of 128 bytes, as CPython writes it::

    _ctypes._unpickle(vllm...pynccl_wrapper.ncclUniqueId, ({}, <128 bytes>))

It walks the opcodes with :func:`pickletools.genops`, which only parses, and refuses every
other opcode, global, shape or size with ``InvalidRequest`` (``bad_unique_id``).  Nothing is
imported, called or constructed; the 128 bytes are returned.
"""

from __future__ import annotations

import pickletools
from typing import Final

from weightsync.core.errors import InvalidRequest

UNIQUE_ID_KEY: Final = "broadcast_from/0/0"
"""The store key of rank 0's first ``broadcast_obj``: the unique id."""

UNIQUE_ID_BYTES: Final = 128
"""``ctypes.sizeof(ncclUniqueId)`` (``NCCL_UNIQUE_ID_BYTES``)."""

MAX_PICKLE_BYTES: Final = 1024
"""The largest store value read (the real one is about 250 bytes)."""

_RECONSTRUCTOR: Final = ("_ctypes", "_unpickle")
_TYPE: Final = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
_NOISE: Final = frozenset({"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})
_STRINGS: Final = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "UNICODE"})
_BYTES: Final = frozenset({"SHORT_BINBYTES", "BINBYTES"})


def _refuse(why: str) -> InvalidRequest:
    return InvalidRequest(
        f"the trainer's store value {UNIQUE_ID_KEY!r} is not vLLM's pickled ncclUniqueId ({why}); "
        "it was not unpickled",
        code="bad_unique_id",
    )


def _ops(data: bytes) -> list[tuple[str, object]]:
    if not isinstance(data, bytes) or len(data) > MAX_PICKLE_BYTES:
        raise _refuse(f"over {MAX_PICKLE_BYTES} bytes" if isinstance(data, bytes) else "not bytes")
    ops: list[tuple[str, object]] = []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "PROTO" and not 3 <= int(arg) <= 5:  # type: ignore[call-overload]
                raise _refuse(f"pickle protocol {arg}")
            if op.name not in _NOISE:
                ops.append((op.name, arg))
    except InvalidRequest:
        raise
    except Exception as exc:  # a malformed or truncated pickle: genops raises ValueError & co
        raise _refuse(f"malformed pickle: {type(exc).__name__}") from None
    return ops


def _global(ops: list[tuple[str, object]], at: int) -> tuple[tuple[str, str], int]:
    """The global named at ``ops[at]``, in either spelling; its value and the next index."""
    name, arg = ops[at]
    if name == "GLOBAL" and isinstance(arg, str) and arg.count(" ") == 1:
        module, attr = arg.split(" ")
        return (module, attr), at + 1
    if (
        at + 2 < len(ops)
        and name in _STRINGS
        and ops[at + 1][0] in _STRINGS
        and ops[at + 2][0] == "STACK_GLOBAL"
    ):
        return (str(arg), str(ops[at + 1][1])), at + 3
    raise _refuse(f"expected a global at opcode {at}, found {name}")


def read_nccl_unique_id(data: bytes) -> bytes:
    """The 128 bytes of the ``ncclUniqueId`` pickled in ``data`` (module docstring).  Raises
    ``InvalidRequest`` (``bad_unique_id``) for anything else; never unpickles."""
    ops = _ops(data)
    try:
        reconstructor, i = _global(ops, 0)
        kind, i = _global(ops, i)
        rest = [name for name, _ in ops[i:]]
    except IndexError:
        raise _refuse("too short") from None
    if reconstructor != _RECONSTRUCTOR or kind != _TYPE:
        raise _refuse(f"names {reconstructor[0]}.{reconstructor[1]} and {kind[0]}.{kind[1]}")
    if len(rest) != 6 or rest[0] != "EMPTY_DICT" or rest[1] not in _BYTES:
        raise _refuse(f"its arguments are {rest[:8]}")
    if rest[2:] != ["TUPLE2", "TUPLE2", "REDUCE", "STOP"]:
        raise _refuse(f"its arguments are {rest[:8]}")
    raw = ops[i + 1][1]
    if not isinstance(raw, bytes) or len(raw) != UNIQUE_ID_BYTES:
        raise _refuse(f"the id is {len(raw) if isinstance(raw, bytes) else type(raw).__name__} bytes")
    return raw
