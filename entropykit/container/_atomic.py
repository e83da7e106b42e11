"""Atomic output: write under a temporary name next to the target, rename on success.

What it is: context managers that hand out a temporary file (or directory) in the target's
own directory and, when the block succeeds, flush it to disk and rename it over the
target; on any error (KeyboardInterrupt included) the temporary is removed, so no partial
output is ever left under the target's name. What it is not: a lock; two writers racing
for one target each write whole files and the last rename wins.

What may be replaced (``force``): a regular file, or a symbolic link (the link itself,
never what it points to). A FIFO or character device (``/dev/null``) is written into,
never replaced: the output is spooled to an unnamed temporary file and copied in once
complete; so is standard output (``Stream``). Anything else (a directory where a file
goes, a block device, a socket) is refused (``OutputRefused``). A directory output that
exists is kept: only the files the run produces are renamed into it, one by one; nothing
else in it is touched.

Temporaries are named ``.NAME.XXXXXXXX.ek-tmp`` and hold an exclusive ``flock`` while
they exist. One left behind by a killed run is removed by the next run writing the same
output when it can prove it stale: same name pattern, same owner, unmodified for
``STALE_SECONDS`` (the margin covers the instant between creating and locking it), and
no process holding its lock (a run still writing keeps its temporary).

Writing and durability without the wait: the file handed out writes in a background
thread (the caller goes on coding meanwhile), and a file's data must be on disk before the
rename, but one fsync of a whole file at the end leaves the caller waiting for all of its
writeback (~25 ms for 45 MB here): every ``SYNC_BYTES`` written start writeback in another
thread (``fdatasync``), so the final fsync only waits for the tail. Those threads come from
a pool that lives for the process: a rank writing many small files would otherwise pay a
thread's start and join per file. An idle pool thread holds nothing (no file, no data);
the idle ones are stopped and joined when the interpreter begins to shut down (with
``threading``'s own exit hooks, before it joins its threads), so none is left for the
interpreter's finalization, where a daemon thread woken mid-teardown can abort the process.
"""

from __future__ import annotations

import atexit
import fcntl
import io
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TypeVar

_T = TypeVar("_T")

TEMP_SUFFIX = ".ek-tmp"
STALE_SECONDS = 60
SYNC_BYTES = 8 << 20  # tail left to the final fsync: ~35 ms -> ~8 ms for 45 MB here
QUEUE_BYTES = 64 << 20  # written data that may wait for the writer thread
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX"))  # buffers per writev
_GROUP_BYTES = 8 << 20  # bytes of queued writes written in one writev call, about
# Queued bytes that wake an idle writer thread: a file of many small segments (a rank's
# shard of many small tensors) hands its writes over a few times, not once a segment,
# each wake-up being a hand-off of the GIL. A caller that waits for the writer wakes it.
_WAKE_BYTES = 2 << 20


# Run before each rename or copy that makes an output visible under its final name: one
# may raise to keep the output unpublished (the command line's check for a signal whose
# handler's raise was lost, e.g. inside a finalizer).
_before_publish: list[Callable[[], None]] = []


@contextmanager
def publish_check(check: Callable[[], None]) -> Iterator[None]:
    """Call ``check`` before each output is published while the block runs."""
    _before_publish.append(check)
    try:
        yield
    finally:
        _before_publish.remove(check)


def _publishing() -> None:
    for check in _before_publish:
        check()


_POOL_IDLE = 32  # idle threads kept; more than this at once (many files written in
# parallel) exit when their file is done


class _Pool:
    """Daemon threads that each run one task at a time and wait, idle, for the next: a
    task gets an idle thread or, when none is idle, a new one (never a queue, so a task
    never waits behind another: a file's writer runs as long as its file is open). Its
    ``done`` is called once the thread is back among the idle ones, so the owner's next
    task finds it there. An exception that escapes a task is reported like one ending a
    thread, and the thread goes on serving. After ``stop`` no thread is kept: each task
    runs on a thread of its own that ends with it (as when there was no pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_PoolThread] = []
        self._stopped = False

    def run(self, task: Callable[[], None], done: Callable[[], None]) -> None:
        with self._lock:
            t = self._idle.pop() if self._idle else None
        if t is None:
            _PoolThread(self, (task, done))
        else:
            t.give((task, done))

    def _rest(self, t: _PoolThread) -> bool:
        """Whether ``t`` is kept idle (False: it exits)."""
        with self._lock:
            if self._stopped or len(self._idle) >= _POOL_IDLE:
                return False
            self._idle.append(t)
            return True

    def stop(self) -> None:
        """End the idle threads and wait for them; keep none from now on. A thread
        busy with a file ends when its task does (its file's close waits for it)."""
        with self._lock:
            self._stopped = True
            idle, self._idle = self._idle, []
        for t in idle:
            t.give(None)
        for t in idle:
            t.join()

    def _forget(self) -> None:
        """In a forked child: the parent's threads do not exist there."""
        self._lock = threading.Lock()
        self._idle = []


_Task = tuple[Callable[[], None], Callable[[], None]]  # the work, then its ``done``


class _PoolThread:
    def __init__(self, pool: _Pool, task: _Task) -> None:
        self._pool = pool
        self._task: _Task | None = None
        self._go = threading.Lock()  # released by ``give``: the next task is there
        self._go.acquire()
        self._thread = threading.Thread(target=self._serve, args=(task,),
                                        name="entropykit-io", daemon=True)
        self._thread.start()

    def give(self, task: _Task | None) -> None:
        """Hand the idle thread its next task (None: end)."""
        self._task = task
        self._go.release()

    def join(self) -> None:
        self._thread.join()

    def _serve(self, task: _Task | None) -> None:
        while task is not None:
            work, done = task
            task = None
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - reported; the thread serves on
                threading.excepthook(threading.ExceptHookArgs(  # type: ignore[call-arg]
                    (type(e), e, e.__traceback__, self._thread)))
            work = None  # nothing of the finished task is kept while idle
            keep = self._pool._rest(self)
            done()
            done = None
            if not keep:
                return
            self._go.acquire()
            task, self._task = self._task, None


_POOL = _Pool()
os.register_at_fork(after_in_child=_POOL._forget)
try:
    # Run by the interpreter's shutdown before it joins threads and tears down (as
    # concurrent.futures' workers are stopped); ``atexit`` also runs before teardown.
    getattr(threading, "_register_atexit", atexit.register)(_POOL.stop)
except RuntimeError:  # imported while the interpreter shuts down: keep no thread
    _POOL.stop()


def submit(fn: Callable[[], _T]) -> Future[_T]:
    """``fn()`` run at once on a thread of the pool (an idle one, else a new one: never
    queued behind other work); its result, or its error, in the future returned. For
    work that starts threads save after save (a checkpoint rank's coding and closing
    threads), which would otherwise pay a thread's start and join each time."""
    fut: Future[_T] = Future()

    def task() -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the future's owner raises it
                fut.set_exception(e)

    _POOL.run(task, _nothing)
    return fut


def _nothing() -> None:
    pass


class _Writeback:
    """A thread that runs ``fdatasync(fd)`` whenever ``kick`` is called (coalescing kicks
    that arrive while one runs); ``close`` waits for it and re-raises its error, if any.
    The thread starts with the first kick: a file smaller than ``SYNC_BYTES`` (most of a
    checkpoint's shard files) never needs it, and a thread's start and join cost more
    than writing a small file."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._wake = threading.Condition()
        self._pending = False
        self._closed = False
        self._error: OSError | None = None
        self._started = False
        self._running = False

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                self._pending = False
            try:
                os.fdatasync(self._fd)
            except OSError as e:  # reported by close; the final fsync would fail too
                self._error = e
                return

    def _ended(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify_all()

    def kick(self) -> None:
        with self._wake:
            self._pending = True
            self._wake.notify()
            start = not self._started  # kicks come from one thread, the file's writer
            self._started = self._running = True
        if start:
            try:
                _POOL.run(self._run, self._ended)
            except BaseException:
                self._ended()  # ``close`` has nothing to wait for
                raise

    def close(self, report: bool = True) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            while self._running:
                self._wake.wait()
        if report and self._error is not None:
            raise self._error


class _OutputFile:
    """The binary file an ``output_file`` block writes: ``write``/``seek``/``truncate``
    queued in order and performed by a background thread, so writing (a copy into the page
    cache, ~14 ms for 45 MB here) overlaps the caller's coding; ``tell`` is tracked here.
    The thread takes what is queued once ``_WAKE_BYTES`` are, or when the caller flushes,
    waits for room or closes. At most ``QUEUE_BYTES`` wait (``write`` blocks beyond
    that), each by reference: the caller must not change a buffer it has handed to
    ``write``. Every ``SYNC_BYTES`` written kick the writeback thread. An error in the
    thread is raised by a later call (at the latest by ``flush`` or ``close``); later
    operations are dropped."""

    def __init__(self, f: BinaryIO, writeback: _Writeback | None) -> None:
        self._f = f
        self._wb = writeback
        self._pos = f.tell()
        self._ops: deque[tuple[str, object, int]] = deque()
        self._queued = 0  # bytes waiting in _ops or being written
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        # Who waits on _cv: a thread is woken only when it waits, since each wake-up hands
        # the GIL to it (with many coding threads, a queue of hand-offs on the caller's).
        self._idle = False  # the writer thread, for operations
        self._waiting = 0  # callers, for room in the queue or for the queue to empty
        self._cv = threading.Condition()
        self._running = True  # till ``_run`` returns (its pool thread then serves others)
        _POOL.run(self._run, self._ended)

    def _ended(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify_all()

    def _run(self) -> None:
        unsynced = 0
        while True:
            with self._cv:
                # Queued operations are taken once _WAKE_BYTES are queued, a caller
                # waits for them, or the file closes.
                while not (self._closed or self._ops and (
                        self._waiting or self._queued >= _WAKE_BYTES)):
                    self._idle = True
                    self._cv.wait()
                    self._idle = False
                if not self._ops:
                    return
                # Everything queued, taken at once: one round trip of the lock (and of the
                # GIL, which the coding threads contend for) per batch, not per operation;
                # each operation's data is let go as soon as it is written.
                ops, self._ops = self._ops, deque()
                self._busy = True
                failed = self._error is not None  # after an error, drop the rest
            error = None
            done = 0
            while ops:
                op, arg, n = ops.popleft()
                done += n
                if failed or error is not None:
                    continue
                try:
                    if op == "write":
                        # The writes queued back to back (up to _GROUP_BYTES), in one
                        # call; their data is let go as soon as that call is done.
                        bufs = [arg]
                        while (ops and ops[0][0] == "write" and len(bufs) < _IOV_MAX
                               and n < _GROUP_BYTES):
                            _, more, m = ops.popleft()
                            bufs.append(more)
                            n += m
                            done += m
                        self._write_all(bufs)  # type: ignore[arg-type]
                        bufs = []
                        unsynced += n
                        if unsynced >= SYNC_BYTES and self._wb is not None:
                            self._f.flush()  # the OS must hold the bytes before fdatasync
                            self._wb.kick()
                            unsynced = 0
                    elif op == "seek":
                        self._f.seek(arg)  # type: ignore[arg-type]
                    else:
                        self._f.truncate(arg)  # type: ignore[arg-type]
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    error = e
            arg = None  # the last write's data is not kept while the thread waits
            with self._cv:
                if error is not None and self._error is None:
                    self._error = error
                self._queued -= done
                self._busy = False
                if self._waiting:
                    self._cv.notify_all()

    def _write_all(self, bufs: list[bytes | memoryview]) -> None:
        """Write ``bufs`` back to back at the file's position with ``os.writev``: one
        release of the GIL for all of them, where a write each would take it back after
        every one (with coding threads busy, a wait for it each time). A file object
        other than Python's own is written through its ``write``."""
        if not isinstance(self._f, (io.BufferedIOBase, io.RawIOBase)):
            for b in bufs:
                self._f.write(b)  # type: ignore[arg-type]
            return
        self._f.flush()
        fd = self._f.fileno()
        views = [memoryview(b).cast("B") for b in bufs]
        at = 0
        while at < len(views):
            k = os.writev(fd, views[at:])
            while k and k >= views[at].nbytes:  # whole buffers written
                k -= views[at].nbytes
                at += 1
            if k:  # a short write ended inside this one
                views[at] = views[at][k:]
            while at < len(views) and not views[at].nbytes:
                at += 1
        self._f.seek(os.lseek(fd, 0, os.SEEK_CUR))  # the file object's position again

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _submit(self, ops: list[tuple[str, object, int]], n: int) -> None:
        """Queue ``ops`` (``n`` bytes of writes in all) under one hold of the lock."""
        with self._cv:
            while self._queued > QUEUE_BYTES and self._error is None:
                self._wait()
            self._raise()
            self._ops.extend(ops)
            self._queued += n
            if self._idle and self._queued >= _WAKE_BYTES:
                self._cv.notify_all()

    def _wait(self) -> None:
        """A caller's wait on ``_cv`` (held) for the writer thread to get on (woken
        first, if it waits for more to be queued)."""
        if self._idle:
            self._cv.notify_all()
        self._waiting += 1
        try:
            self._cv.wait()
        finally:
            self._waiting -= 1

    def write(self, data: bytes | memoryview) -> int:
        n = memoryview(data).nbytes
        self._submit([("write", data, n)], n)
        self._pos += n
        return n

    def writelines(self, lines: Iterable[bytes | memoryview]) -> None:
        """``write`` of each buffer in order, queued at once: a coded segment's payloads
        take one round trip of the lock, not one each."""
        ops: list[tuple[str, object, int]] = [("write", b, memoryview(b).nbytes) for b in lines]
        n = 0
        for op in ops:
            n += op[2]
        self._submit(ops, n)
        self._pos += n

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET or pos < 0:
            raise ValueError("only absolute seeks to positions >= 0 are supported")
        self._submit([("seek", pos, 0)], 0)
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def truncate(self, size: int | None = None) -> int:
        self._submit([("truncate", size, 0)], 0)
        return self._pos if size is None else size

    def flush(self) -> None:
        """Wait until every queued operation is done; raise the thread's error, if any."""
        with self._cv:
            while (self._ops or self._busy) and self._error is None:
                self._wait()
            self._raise()
        self._f.flush()

    def close(self, report: bool = True) -> None:
        """Finish the queue (``report``) or drop it, stop the thread; raise its error if
        ``report``."""
        with self._cv:
            if not report and self._error is None:
                self._error = OSError("output abandoned")  # drop what is still queued
            self._closed = True
            self._cv.notify_all()
            while self._running:  # woken by ``_ended``
                try:
                    self._cv.wait()
                except BaseException:  # interrupted: the writer drops what is queued
                    if self._error is None:
                        self._error = OSError("output abandoned")
                    raise
        if report:
            self._raise()

    def fileno(self) -> int:
        return self._f.fileno()


class OutputRefused(ValueError):
    """An output that must not be written: it would replace something that is not a
    regular file, or overlap the input (a usage error: exit 2 in the command line)."""


def is_temp(name: str) -> bool:
    """Whether a file name has the form of an entropykit temporary (``.*.ek-tmp``)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def check_distinct(src: Path, dst: Path) -> None:
    """OutputRefused if ``dst`` is, contains or lies inside ``src`` (symlinks resolved)."""
    rs, rd = Path(os.path.realpath(src)), Path(os.path.realpath(dst))
    same = rs == rd or (dst.exists() and os.path.samefile(src, dst))  # hard links too
    if same:
        raise OutputRefused(f"{dst}: output would overwrite the input {src}")
    if rd in rs.parents:
        raise OutputRefused(f"{dst}: output would contain the input {src}")
    if rs in rd.parents:
        raise OutputRefused(f"{dst}: output would lie inside the input {src}")


def _is_stream(mode: int) -> bool:
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def check_target(dst: Path, force: bool) -> bool:
    """Whether file output ``dst`` is a stream (a FIFO or character device, or a link to
    one) to write into. FileNotFoundError if its directory does not exist;
    FileExistsError if it exists and ``force`` is not set; OutputRefused if it is
    something that may not be replaced."""
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"{dst}: output directory {dst.parent} does not exist")
    try:
        mode = os.lstat(dst).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(mode):
        try:
            if _is_stream(os.stat(dst).st_mode):
                return True
        except OSError:
            pass  # a dangling link: replaced like a file
    elif _is_stream(mode):
        return True
    elif not stat.S_ISREG(mode):
        raise OutputRefused(f"{dst}: output exists and is not a regular file "
                            f"({_kind(mode)}); refusing to replace it")
    if not force:
        raise FileExistsError(f"{dst}: output exists (use --force / force=True to overwrite)")
    return False


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISFIFO, "a FIFO")):
        if test(mode):
            return name
    return "a special file"


def _temp_name(dst: Path) -> tuple[str, str]:
    return f".{dst.name}.", TEMP_SUFFIX


_UMASK = threading.Lock()


def _umask() -> int:
    """The process's umask. Reading it means setting it for an instant: the lock keeps
    two threads writing outputs at once (a rank's shard files) from reading each other's
    stand-in value and giving a file the wrong mode."""
    with _UMASK:
        mask = os.umask(0o22)
        os.umask(mask)
    return mask


def _lock(fd: int) -> None:
    """Hold an exclusive lock on a temporary while it exists (the proof that a run still
    owns it); a filesystem without locks only makes the temporary unprovable, never lost."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass


# A temporary's name: "." + its output's name + "." + 8 characters of mkstemp + suffix.
_TEMP = re.compile(r"\.(.+)\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX), re.DOTALL)


def temp_target(name: str) -> str | None:
    """The output name whose temporary ``name`` is (``.NAME.XXXXXXXX.ek-tmp`` -> NAME),
    or None for any other name."""
    m = _TEMP.fullmatch(name)
    return None if m is None else m.group(1)


def remove_stale(dst: Path) -> list[Path]:
    """Remove the temporaries of output ``dst`` that a killed run left (see the module
    docstring for the proof required); returns what was removed."""
    removed = remove_stale_in(dst.parent, lambda target: target == dst.name)
    if dst.is_dir() and not dst.is_symlink():
        # an existing output directory holds its run's temporary
        removed += remove_stale_in(dst, lambda target: target == dst.name)
    return removed


def remove_stale_in(directory: Path, wanted: Callable[[str], bool]) -> list[Path]:
    """Remove, in one listing of ``directory``, the temporaries that a killed run left of
    every output whose name passes ``wanted`` (those proven stale, as ``remove_stale``):
    a caller writing many outputs into one directory clears them all at once instead of
    listing the directory once per output. Returns what was removed."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    removed = []
    for name in names:
        target = temp_target(name)
        if target is not None and wanted(target) and _remove_if_stale(directory / name):
            removed.append(directory / name)
    return removed


def _remove_if_stale(p: Path) -> bool:
    try:
        st = os.lstat(p)
        if (st.st_uid != os.geteuid() or time.time() - st.st_mtime < STALE_SECONDS
                or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))):
            return False
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_ino != st.st_ino:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a live run owns it
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(p)
        else:
            p.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@contextmanager
def _writer(f: BinaryIO, sync: bool) -> Iterator[_OutputFile]:
    """``f`` written through an ``_OutputFile`` (with writeback if ``sync``), finished and
    (if ``sync``) on disk when the block exits; dropped on error."""
    wb = _Writeback(f.fileno()) if sync else None
    out = _OutputFile(f, wb)
    try:
        yield out
    except BaseException:
        out.close(report=False)  # the block's own error is the one to see
        if wb is not None:
            wb.close(report=False)
        raise
    try:
        out.close()
    finally:
        if wb is not None:
            wb.close()  # before the file closes: the thread must not sync a reused fd
    f.flush()
    if sync:
        os.fsync(f.fileno())


class Stream:
    """An output that is an open binary stream (standard output): the whole output is
    spooled to an unnamed temporary file and copied into ``file`` once complete, so a
    failed run writes nothing to it. ``name`` is what messages call it."""

    def __init__(self, file: BinaryIO, name: str = "<stdout>") -> None:
        self.file, self.name = file, name

    def __str__(self) -> str:
        return self.name


@contextmanager
def _spooled(copy: Callable[[BinaryIO], None]) -> Iterator[BinaryIO]:
    """A file written to an unnamed temporary, handed to ``copy`` once complete."""
    with tempfile.TemporaryFile() as spool:
        with _writer(spool, False) as out:
            yield out  # type: ignore[misc]
        spool.seek(0)
        _publishing()
        copy(spool)


@contextmanager
def output_file(dst: Path | Stream, force: bool = False, *, sweep: bool = True
                ) -> Iterator[BinaryIO]:
    """A binary file to write ``dst`` through; renamed over ``dst`` when the block exits
    (written into ``dst`` if it is a FIFO or character device, or a ``Stream``).
    ``sweep=False`` leaves a killed run's temporaries of ``dst`` to the caller (one
    ``remove_stale_in`` for all the outputs it writes into a directory)."""
    if isinstance(dst, Stream):
        stream = dst

        def into(spool: BinaryIO) -> None:
            shutil.copyfileobj(spool, stream.file, 1 << 20)
            stream.file.flush()

        with _spooled(into) as out:
            yield out
        return
    dst = Path(dst)
    if check_target(dst, force):
        with _spooled(lambda spool: _copy_into(spool, dst)) as out:
            yield out
        return
    if sweep:
        remove_stale(dst)
    pre, suf = _temp_name(dst)
    fd, tmp = tempfile.mkstemp(prefix=pre, suffix=suf, dir=dst.parent)
    lock = os.dup(fd)  # the lock lives until the rename is done
    try:
        _lock(lock)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
        with os.fdopen(fd, "w+b") as f, _writer(f, True) as out:
            yield out  # type: ignore[misc]
        if check_target(dst, force):  # someone may have created it meanwhile
            raise OutputRefused(f"{dst}: became a FIFO or device while writing")
        _publishing()
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        os.close(lock)


def _copy_into(spool: BinaryIO, dst: Path) -> None:
    """Copy the finished ``spool`` into stream ``dst`` (opened without creating or
    truncating anything; a FIFO waits here for its reader)."""
    fd = os.open(dst, os.O_WRONLY)
    with open(fd, "wb") as f:
        if not _is_stream(os.fstat(fd).st_mode):
            raise OutputRefused(f"{dst}: is no longer a FIFO or device; not written")
        shutil.copyfileobj(spool, f, 1 << 20)


def _installable(dst: Path, rel: Path, is_dir: bool = False) -> None:
    """OutputRefused unless ``rel`` (a file or link, or a directory if ``is_dir``) can be
    put in existing directory ``dst``: every directory on the way is a real directory (or
    absent), and the name is absent, or a regular file or symbolic link (replaced, never
    followed), or for a directory a real directory."""
    here = dst
    for part in rel.parts:
        here = here / part
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            return
        last = here == dst / rel
        if last and not is_dir:
            if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                raise OutputRefused(f"{here}: output exists and is {_kind(mode)}; "
                                    f"refusing to replace it")
        elif not stat.S_ISDIR(mode):
            raise OutputRefused(f"{here}: output path is {_kind(mode)}, not a directory; "
                                f"refusing to write {dst / rel} through it")


def _install(tmp: Path, dst: Path) -> None:
    """Rename every file and link of ``tmp`` to the same place in existing ``dst``."""
    for top, dirs, names in os.walk(tmp):
        rel = Path(top).relative_to(tmp)
        for d in list(dirs):
            if (Path(top) / d).is_symlink():  # os.walk lists links to directories here
                dirs.remove(d)
                names.append(d)
            else:
                _installable(dst, rel / d, is_dir=True)
                (dst / rel / d).mkdir(exist_ok=True)
        for name in sorted(names):
            _installable(dst, rel / name)
            os.replace(Path(top) / name, dst / rel / name)


@contextmanager
def output_dir(dst: Path, force: bool = False, names: Iterable[Path] = ()
               ) -> Iterator[Path]:
    """A directory to fill for output directory ``dst``.

    A new ``dst`` is the temporary directory renamed when the block exits. An existing
    ``dst`` (with ``force``; a link to a directory stands for that directory) is kept: the
    block fills a temporary directory inside it, whose files and links then replace their
    namesakes in ``dst`` one by one (each by a rename); nothing else in ``dst`` is touched.
    ``names`` (relative paths the block will write) are checked up front, so a refused
    output costs no work.
    """
    dst = Path(dst)
    if dst.is_symlink() and dst.is_dir():
        dst = Path(os.path.realpath(dst))  # written into, like any existing directory
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"{dst}: output directory {dst.parent} does not exist")
    try:
        mode = os.lstat(dst).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISDIR(mode):
            raise OutputRefused(f"{dst}: output exists and is {_kind(mode)}, not a "
                                f"directory; refusing to replace it")
        if not force:
            raise FileExistsError(f"{dst}: output exists (use --force / force=True to "
                                  f"write into it)")
        for rel in names:
            _installable(dst, Path(rel))
    remove_stale(dst)
    pre, suf = _temp_name(dst)
    tmp = Path(tempfile.mkdtemp(prefix=pre, suffix=suf, dir=dst if mode else dst.parent))
    lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _lock(lock)
        tmp.chmod(0o777 & ~_umask())
        yield tmp
        if mode is None:
            if os.path.lexists(dst):
                raise FileExistsError(f"{dst}: output appeared while writing; not replaced")
            _publishing()
            os.rename(tmp, dst)
        else:
            _publishing()  # once: the files then replace their namesakes one by one
            _install(tmp, dst)
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
