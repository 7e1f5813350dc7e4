"""How a role call's arguments and results cross between the controller and the workers: one stdlib pickle each,
which Ray passes on as bytes.

Ray serialises each argument and result of a task on its own, anything but a primitive through cloudpickle's
pure-Python pickler; a role call's are a few small dataclasses (RowsFrom, Timed) and small arrays, which the C
pickler takes in one pass (a no-op call's round trip through a Ray actor, its arguments and result shaped like a
log-prob call's: 1.33 ms as Ray serialises them, 0.85 ms packed so; medians of 500, on this 2-core VM under load).
A pickle that nothing travels beside goes alone, as one bytes argument or result: Ray passes bytes through without a
pickler, while each list beside them costs a cloudpickle pass on both sides (a no-op call with a 2 KB pickle, medians
of 6 alternating rounds of 200 calls, bench/wire_args.py, 2026-12-06 under load 11.6: a round trip of 0.80 ms and
0.38 ms of the caller's CPU alone, 0.99 and 0.47 ms with two empty lists beside it). Two things stay Ray's:
- arrays of at least OUT_OF_BAND_BYTES leave the pickle (protocol 5's out-of-band buffers) and travel beside it
  as arrays, which Ray moves without copies of its own (through its object store when large);
- the Ray references a call's fields read (another worker's outputs) travel beside it as a list Ray knows, so
  that Ray counts them as the call's (a reference hidden in bytes would be invisible to its reference counting).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np

OUT_OF_BAND_BYTES = 64 * 1024  # below Ray's own inline limit (100 KiB): only large arrays take Ray's path


@dataclass(frozen=True)
class CallFailed:
    """What a role call that raised returns in place of its outputs (SetWorker.calls): the error's last line."""

    error: str


class _Pickler(pickle.Pickler):
    """Large arrays out of the stream (`buffers`)."""

    def __init__(self, sink: io.BytesIO, buffers: list[np.ndarray]) -> None:
        super().__init__(sink, protocol=5, buffer_callback=self._buffer)
        self.buffers = buffers
        self.refs: list = []

    def _buffer(self, buffer: pickle.PickleBuffer) -> bool:
        """In-band (True) below the threshold; else out-of-band, as a flat uint8 array over the same memory."""
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND_BYTES:
            return True
        self.buffers.append(np.frombuffer(raw, dtype=np.uint8))
        return False


class _RefPickler(_Pickler):
    """Also Ray references out of the stream, by their index in `refs` (persistent ids). The pickler asks
    persistent_id of every object it writes, a Python call each: about half of a call's result's pickling time,
    hence a pickler of its own."""

    def __init__(self, sink: io.BytesIO, buffers: list[np.ndarray], ref_type: type) -> None:
        super().__init__(sink, buffers)
        self.ref_type = ref_type
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, self.ref_type):
            return None
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.refs)
            self.refs.append(obj)
        return index


class _Unpickler(pickle.Unpickler):
    def __init__(self, blob: bytes, buffers: list | tuple, refs: list | tuple) -> None:
        super().__init__(io.BytesIO(blob), buffers=buffers)
        self.refs = refs

    def persistent_load(self, index: int) -> Any:
        return self.refs[index]


def _ref_type() -> type | None:
    """Ray's reference class where Ray is imported (the controller and the workers), else None."""
    import sys

    ray = sys.modules.get("ray")
    return getattr(ray, "ObjectRef", None) if ray is not None else None


Packed = bytes | tuple[bytes, list[np.ndarray], list]


def pack(obj: Any, *, refs: bool = True) -> Packed:
    """`obj` as its pickle alone when nothing travels beside it, else (pickle, out-of-band arrays, Ray references).
    `refs=False`: `obj` holds no Ray reference (a role call's result), so none is looked for."""
    sink = io.BytesIO()
    buffers: list[np.ndarray] = []
    ref_type = _ref_type() if refs else None
    pickler = _Pickler(sink, buffers) if ref_type is None else _RefPickler(sink, buffers, ref_type)
    pickler.dump(obj)
    if not buffers and not pickler.refs:
        return sink.getvalue()
    return sink.getvalue(), buffers, pickler.refs


def arguments(packed: Packed) -> tuple:
    """A packed object as a Ray call's positional arguments (SetWorker.calls takes one to three)."""
    return (packed,) if isinstance(packed, bytes) else packed


def unpack(blob: bytes, buffers: list | tuple = (), refs: list | tuple = ()) -> Any:
    """The object `pack` took apart (arrays read from out-of-band buffers view them: read-only where Ray's are)."""
    return _Unpickler(blob, buffers, refs).load()


def unpack_packed(packed: Packed) -> Any:
    """The object `pack` made `packed` from (a call's result as Ray returns it)."""
    return unpack(*arguments(packed))
