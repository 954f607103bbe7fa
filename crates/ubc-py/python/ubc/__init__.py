"""ubc: stackable layers (dir, mem, zstd, aead, union, ...) over a user-space unified buffer cache.

    >>> import ubc
    >>> ubc.generate_key("/tmp/k")
    >>> stack = ubc.Stack("dir:/tmp/data | zstd | aead:keyfile=/tmp/k")
    >>> with stack.open("notes.txt", "wb") as f:       # cleartext at the top
    ...     f.write(b"meet at noon")
    >>> stack.layer(0).open("notes.txt").read()        # ciphertext as stored

Files are ``io`` objects (``BufferedReader``/``BufferedWriter``/``BufferedRandom`` over
:class:`RawFile`, or the :class:`RawFile` itself with ``raw=True``); ``f.map()`` gives a
zero-copy :class:`Mapping` exporting the buffer protocol. Errors are ``OSError``
subclasses chosen by errno (``FileNotFoundError``, ``PermissionError``,
``IsADirectoryError``, ...); authentication failures of an encryption layer raise
:class:`AuthenticationError`. I/O runs with the GIL released.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable, Optional, Union

from . import _ubc
from ._ubc import AuthenticationError, Cache, Mapping, StatResult, generate_key, stats

__all__ = [
    "AuthenticationError",
    "Cache",
    "Layer",
    "Mapping",
    "RawFile",
    "Stack",
    "StatResult",
    "generate_key",
    "stats",
]

DEFAULT_BUDGET = 256 << 20

_PathLike = Union[str, "os.PathLike[str]"]


def _parse_mode(mode: str) -> tuple[bool, bool, bool, bool, bool, bool]:
    """(readable, writable, create, truncate, append, exclusive) of a binary mode."""
    if not isinstance(mode, str):
        raise TypeError(f"mode must be str, not {type(mode).__name__}")
    chars = set(mode)
    if len(chars) != len(mode) or not chars <= set("rwaxb+t"):
        raise ValueError(f"invalid mode: {mode!r}")
    if "t" in chars or "b" not in chars:
        raise ValueError(f"ubc files are binary: text mode {mode!r} is not supported (use e.g. 'rb', then io.TextIOWrapper)")
    primary = chars & set("rwax")
    if len(primary) != 1:
        raise ValueError(f"mode {mode!r} must have exactly one of r, w, a, x")
    (p,) = primary
    plus = "+" in chars
    if p == "r":
        return True, plus, False, False, False, False
    if p == "w":
        return plus, True, True, True, False, False
    if p == "a":
        return plus, True, True, False, True, False
    return plus, True, True, False, False, True  # x


class RawFile(io.RawIOBase):
    """Unbuffered binary file of one stack layer (an ``io.RawIOBase``).

    Keeps the position; reads and writes are positional calls into the cache with the GIL
    released. ``flush()`` is a no-op, as for ``io.FileIO``; ``sync()`` pushes data down
    through the layers below and makes it durable (it also runs on ``close()`` of a
    writable file).
    """

    def __init__(self, native: Any, name: str, mode: str, readable: bool, writable: bool, append: bool) -> None:
        super().__init__()
        self._f = native
        self.name = name
        self.mode = mode
        self._readable = readable
        self._writable = writable
        self._append = append
        self._pos = 0

    # -- capabilities
    def readable(self) -> bool:
        self._checkClosed()
        return self._readable

    def writable(self) -> bool:
        self._checkClosed()
        return self._writable

    def seekable(self) -> bool:
        self._checkClosed()
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation("ubc files have no file descriptor")

    def isatty(self) -> bool:
        self._checkClosed()
        return False

    # -- I/O
    def readinto(self, b: Any) -> int:
        self._checkClosed()
        if not self._readable:
            raise io.UnsupportedOperation("not readable")
        m = memoryview(b)
        if m.format != "B" or m.ndim != 1:
            m = m.cast("B")
        n = self._f.read_into(m, self._pos)
        self._pos += n
        return n

    def readall(self) -> bytes:
        self._checkClosed()
        if not self._readable:
            raise io.UnsupportedOperation("not readable")
        size = self._f.len()
        out = bytearray(max(size - self._pos, 0))
        got = 0
        while got < len(out):
            n = self.readinto(memoryview(out)[got:])
            if not n:
                break
            got += n
        del out[got:]
        # Whatever grew meanwhile.
        while True:
            chunk = bytearray(1 << 16)
            n = self.readinto(chunk)
            if not n:
                break
            out += chunk[:n]
        return bytes(out)

    def write(self, b: Any) -> int:
        self._checkClosed()
        if not self._writable:
            raise io.UnsupportedOperation("not writable")
        m = memoryview(b)
        if m.format != "B" or m.ndim != 1:
            m = m.cast("B")
        if self._append:
            self._pos = self._f.len()
        n = self._f.write_at(m, self._pos)
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._f.len() + offset
        else:
            raise ValueError(f"invalid whence ({whence!r})")
        if pos < 0:
            raise OSError(22, f"negative seek position {pos}")
        self._pos = pos
        return pos

    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def truncate(self, size: Optional[int] = None) -> int:
        self._checkClosed()
        if not self._writable:
            raise io.UnsupportedOperation("not writable")
        if size is None:
            size = self._pos
        if size < 0:
            raise OSError(22, f"negative size {size}")
        self._f.set_len(size)
        return size

    def sync(self, data_only: bool = False) -> None:
        """Push the data down through every layer below and make it durable (``os.fsync``;
        ``data_only``: ``os.fdatasync``, without the times)."""
        self._checkClosed()
        self._f.sync(data_only)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._writable:
                self._f.sync()
        finally:
            self._f.close()
            super().close()

    # -- ubc extras
    def advise(self, offset: int, length: int, advice: int) -> None:
        """``os.posix_fadvise`` for this file: ``advice`` is one of ``os.POSIX_FADV_*``.

        ``NORMAL``, ``RANDOM``, ``SEQUENTIAL`` and ``NOREUSE`` set this handle's access
        pattern (read-ahead and how long read pages stay); ``WILLNEED`` starts filling the
        range; ``DONTNEED`` writes its dirty pages back and drops it. A ``length`` of 0
        means to the end of the file.
        """
        self._checkClosed()
        self._f.advise(offset, length, advice)

    def set_writeback_hook(self, hook: Optional[Callable[[int, int], object]]) -> None:
        """Call ``hook(offset, length)`` before any of this file's bytes are written back.

        Write-ahead logging: the write waits until the hook returns, so a program that
        appends each change to its log before making it and makes the log durable in the
        hook never has a change in the store that its log lacks. An exception fails that
        write (the data stays in the cache, ``sync()`` raises). The hook runs on one of the
        cache's threads (or the thread that needed the write): it must not use this file or
        its cache, and it takes the GIL. Do not store into a writable mapping of a file of
        the same cache from Python while a hooked file has unwritten data: a store that
        faults while holding the GIL can need room that only the hook can free. ``None``
        removes the hook.
        """
        self._checkClosed()
        self._f.set_writeback_hook(hook)

    def map(self, offset: int = 0, length: Optional[int] = None, writable: bool = False) -> Mapping:
        """Map ``length`` bytes from ``offset`` (to the end of the file if None).

        The result exports the buffer protocol (zero copy): ``memoryview(m)``,
        ``numpy.frombuffer(m, dtype=...)``. Read-only unless ``writable`` (a shared mapping
        whose stores reach the file; ``m.flush()`` writes them back).
        """
        self._checkClosed()
        return self._f.map(offset, length, writable)

    def __len__(self) -> int:
        self._checkClosed()
        return self._f.len()

    @property
    def layer_index(self) -> int:
        return self._f.layer_index

    def __repr__(self) -> str:
        return f"<ubc.RawFile name={self.name!r} mode={self.mode!r}{' closed' if self.closed else ''}>"


class _MapMixin:
    """``map()``, ``sync()`` and ``__len__`` on buffered files (flushing their buffer first)."""

    raw: RawFile

    def map(self, offset: int = 0, length: Optional[int] = None, writable: bool = False) -> Mapping:
        if self.writable():  # type: ignore[attr-defined]
            self.flush()  # type: ignore[attr-defined]
        return self.raw.map(offset, length, writable)

    def sync(self, data_only: bool = False) -> None:
        self.flush()  # type: ignore[attr-defined]
        self.raw.sync(data_only)

    def set_writeback_hook(self, hook: Optional[Callable[[int, int], object]]) -> None:
        """:meth:`RawFile.set_writeback_hook` (the buffer is flushed as the hook allows)."""
        self.raw.set_writeback_hook(hook)

    def advise(self, offset: int, length: int, advice: int) -> None:
        """:meth:`RawFile.advise` (a ``DONTNEED`` flushes this object's buffer first)."""
        if advice == os.POSIX_FADV_DONTNEED and self.writable():  # type: ignore[attr-defined]
            self.flush()  # type: ignore[attr-defined]
        self.raw.advise(offset, length, advice)

    def __len__(self) -> int:
        if self.writable():  # type: ignore[attr-defined]
            self.flush()  # type: ignore[attr-defined]
        return len(self.raw)


class BufferedReader(_MapMixin, io.BufferedReader):
    """``io.BufferedReader`` over a :class:`RawFile`, plus ``map()``."""


class BufferedWriter(_MapMixin, io.BufferedWriter):
    """``io.BufferedWriter`` over a :class:`RawFile`, plus ``map()`` and ``sync()``."""


class BufferedRandom(_MapMixin, io.BufferedRandom):
    """``io.BufferedRandom`` over a :class:`RawFile`, plus ``map()`` and ``sync()``."""


class Layer:
    """One layer of a :class:`Stack` (0 is the bottom): opens and namespace operations there."""

    def __init__(self, native: Any) -> None:
        self._l = native

    @property
    def index(self) -> int:
        return self._l.index

    @property
    def spec(self) -> str:
        return self._l.spec

    def open(
        self,
        path: _PathLike,
        mode: str = "rb",
        buffering: int = -1,
        *,
        raw: bool = False,
    ) -> Union[RawFile, BufferedReader, BufferedWriter, BufferedRandom]:
        """Open ``path`` at this layer. Modes: ``rb``, ``r+b``, ``wb``, ``w+b``, ``ab``,
        ``a+b``, ``xb``, ``x+b``; text modes raise ValueError.

        Returns a buffered file (``BufferedReader``/``BufferedWriter``/``BufferedRandom``),
        or the :class:`RawFile` with ``raw=True`` or ``buffering=0``.
        """
        p = os.fspath(path)
        readable, writable, create, truncate, append, exclusive = _parse_mode(mode)
        if exclusive:
            try:
                self._l.stat(p)
            except FileNotFoundError:
                pass
            else:
                raise FileExistsError(17, f"{p}: file exists")
        native = self._l.open(p, writable, create, truncate)
        f = RawFile(native, p, mode, readable, writable, append)
        if append:
            f.seek(0, io.SEEK_END)
        if raw or buffering == 0:
            return f
        size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE * 16
        if readable and writable:
            return BufferedRandom(f, size)
        if writable:
            return BufferedWriter(f, size)
        return BufferedReader(f, size)

    def stat(self, path: _PathLike = "") -> StatResult:
        """Attributes of ``path`` as this layer shows them (``size``, ``mode``, ``kind``,
        ``mtime``, ``atime``, ``ino``)."""
        return self._l.stat(os.fspath(path))

    def exists(self, path: _PathLike) -> bool:
        try:
            self._l.stat(os.fspath(path))
        except FileNotFoundError:
            return False
        return True

    def listdir(self, path: _PathLike = "") -> list[str]:
        """Names in directory ``path`` (sorted)."""
        return sorted(name for name, _ in self._l.listdir(os.fspath(path)))

    def scandir(self, path: _PathLike = "") -> list[tuple[str, str]]:
        """(name, kind) pairs of directory ``path``; kind is "file", "dir" or "symlink"."""
        return self._l.listdir(os.fspath(path))

    def mkdir(self, path: _PathLike) -> None:
        self._l.mkdir(os.fspath(path))

    def rmdir(self, path: _PathLike) -> None:
        self._l.rmdir(os.fspath(path))

    def remove(self, path: _PathLike) -> None:
        self._l.remove(os.fspath(path))

    unlink = remove

    def rename(self, src: _PathLike, dst: _PathLike) -> None:
        """Rename ``src`` to ``dst`` (replacing a file at ``dst``)."""
        self._l.rename(os.fspath(src), os.fspath(dst))

    def __repr__(self) -> str:
        return f"<ubc.Layer {self.index}: {self.spec}>"


class Stack:
    """A stack of layers over one cache, e.g. ``Stack("dir:/data | zstd | aead:keyfile=/k")``.

    Every layer is reachable (:meth:`layer`) and all views of a file are kept coherent.
    With ``cache=None`` a cache with a 256 MiB budget is made for this stack.
    """

    def __init__(self, spec: str, cache: Optional[Cache] = None) -> None:
        self.cache = cache if cache is not None else Cache(DEFAULT_BUDGET)
        self._s = _ubc.RawStack(spec, self.cache)

    @property
    def depth(self) -> int:
        """Number of layers."""
        return self._s.depth

    @property
    def spec(self) -> str:
        return self._s.spec

    def layer(self, i: int) -> Layer:
        """Layer ``i`` (0 is the bottom; negative counts from the top)."""
        if i < 0:
            i += self.depth
            if i < 0:
                raise IndexError("layer index out of range")
        return Layer(self._s.layer(i))

    @property
    def top(self) -> Layer:
        return self.layer(self.depth - 1)

    def open(self, path: _PathLike, mode: str = "rb", buffering: int = -1, *, raw: bool = False):  # type: ignore[no-untyped-def]
        """The top layer's :meth:`Layer.open`."""
        return self.top.open(path, mode, buffering, raw=raw)

    def stat(self, path: _PathLike = "") -> StatResult:
        return self.top.stat(path)

    def listdir(self, path: _PathLike = "") -> list[str]:
        return self.top.listdir(path)

    def mkdir(self, path: _PathLike) -> None:
        self.top.mkdir(path)

    def remove(self, path: _PathLike) -> None:
        self.top.remove(path)

    def rename(self, src: _PathLike, dst: _PathLike) -> None:
        self.top.rename(src, dst)

    def sync_all(self) -> None:
        """Write every dirty page down through the stack and sync the stores."""
        self._s.sync_all()

    def stats(self) -> dict[str, Any]:
        """Cache statistics plus coherence and name-cache counters."""
        return self._s.stats()

    def __repr__(self) -> str:
        return f"<ubc.Stack {self.spec!r}>"
