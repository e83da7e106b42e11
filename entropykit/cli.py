"""The ``entropykit`` command: compress, decompress, verify and inspect safetensors files.

What it is: argument parsing, a progress line on stderr (when it is a terminal), the
summary table on stdout (on stderr when the data goes to stdout; nothing with ``-q``),
``-`` for standard input and output, and exit codes scripts can rely on:

    0  success
    1  bad data: a corrupt, truncated or non-safetensors input, an unsupported dtype,
       a missing shard, a verify mismatch, or an I/O error
    2  bad usage: wrong arguments, a PATH that does not exist, an output that exists
       (without --force), an output that is, contains or lies inside the input, or one
       that may not be replaced (a directory where a file goes, a device, a socket)
    128+N  killed by signal N: SIGINT (130), SIGHUP (129) or SIGTERM (143)
    141    standard output closed by its reader (``entropykit info F | head``): the
           run stops without a message, as a tool killed by SIGPIPE does

With several PATHs, a PATH that fails is reported and the others still run; the exit
code is the worst one.

Errors are one line on stderr naming the file and the problem; no partial output is left,
whether the run fails or is interrupted by one of those signals.
What it is not: the work itself (``entropykit.api`` and ``entropykit.container``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from . import __version__
from .container import _atomic, checkpoint, files
from .container.parallel import resolve
from .container.progress import Bar
from .container.reader import Compressed, is_compressed, read_header
from .container.stats import Row, Summary

EXIT_OK, EXIT_DATA, EXIT_USAGE = 0, 1, 2
EXIT_PIPE = 128 + 13  # SIGPIPE: standard output was closed by its reader
_CODES = """exit codes: 0 success; 1 corrupt/unsupported input, verify mismatch or I/O error;
2 bad usage (arguments, missing PATH, existing output without --force, output overlapping
the input or not replaceable); 130/129/143 interrupted by SIGINT/SIGHUP/SIGTERM (nothing
left behind); 141 standard output closed by its reader (e.g. | head), silently. With
several PATHs each is reported and the worst code is returned."""
_FORCE = ("replace OUT if it exists: a file OUT (or a symbolic link, never what it points "
          "to) is replaced once the new one is complete; into an existing directory OUT "
          "only the files this run writes are replaced, every other file in it is kept. "
          "A FIFO or character device OUT (e.g. /dev/null) is written into, --force or not")
_SIGNALS = ("SIGHUP", "SIGTERM")


class _Usage(Exception):
    """A usage problem found after parsing (exit 2)."""


class _Signalled(BaseException):
    """SIGHUP or SIGTERM arrived: unwinds like KeyboardInterrupt, removing temporaries."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                      strict=True))]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _summary_table(s: Summary, bound: bool, decoding: bool = False) -> str:
    """Rows per dtype; ``decoding``: "MB in" is the compressed side, "MB out" the original."""
    head = ["dtype", "tensors", "values", "MB in", "MB out", "ratio", "bits/value"]
    if bound:
        head.append("order-0 bound")

    def line(name: str, r: Row) -> list[str]:
        sizes = [r.bytes_out, r.bytes_in] if decoding else [r.bytes_in, r.bytes_out]
        cells = [name, f"{r.tensors:,}", f"{r.values:,}", *map(_fmt_bytes, sizes),
                 f"{r.ratio:.4f}", f"{r.bits_per_value:.3f}"]
        if bound:
            cells.append(f"{r.bound_per_value:.3f}")
        return cells

    rows = [head] + [line(k, r) for k, r in sorted(s.rows.items())]
    if len(s.rows) > 1:
        rows.append(line("total", s.total))
    return _table(rows)


def _report(args: argparse.Namespace, verb: str, s: Summary, src: object,
            dst: object | None, out: TextIO | None = None) -> None:
    """The table, then one line; MB/s are of original bytes, whatever the direction.
    Nothing with -q; on stderr when the data itself goes to stdout."""
    if args.quiet:
        return
    out = sys.stdout if out is None else out
    print(_summary_table(s, verb == "compress", decoding=verb == "decompress"), file=out)
    original, packed = (s.original_bytes, s.compressed_bytes)
    n = f"{s.files} file{'s' if s.files != 1 else ''}"
    where = f" -> {dst}" if dst is not None else ""
    print(f"\n{verb} {src}{where}: {n}, original {_fmt_bytes(original)} MB, compressed "
          f"{_fmt_bytes(packed)} MB, ratio {s.ratio:.4f}, {s.seconds:.2f} s, "
          f"{s.mb_per_s(original):,.1f} MB/s", file=out)


def _progress(args: argparse.Namespace, label: str) -> Bar | None:
    if args.quiet or not sys.stderr.isatty():
        return None
    return Bar(label)


def _existing(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise _Usage(f"{p}: no such file or directory")
    return p


@contextmanager
def _stdin_spool() -> Iterator[Path]:
    """Standard input copied to an unnamed temporary file in $TMPDIR (compress reads a
    regular file it can check for changes; decompress maps one), as a path to open; the
    file has no name, so nothing is left behind even if the run is killed."""
    if sys.stdin is None or sys.stdin.isatty():
        raise _Usage("-: standard input is a terminal; pipe a file in or give PATH")
    with tempfile.TemporaryFile() as spool:
        shutil.copyfileobj(sys.stdin.buffer, spool, 1 << 20)
        spool.flush()
        yield Path(f"/proc/self/fd/{spool.fileno()}")


def _check_plan(args: argparse.Namespace) -> bool:
    """Usage checks across the inputs; returns whether the data goes to standard output."""
    paths = args.path
    to_stdout = args.stdout or args.output == "-"
    stdin = "-" in paths
    if stdin and args.output is None:
        to_stdout = True  # like zstd: a stream in, a stream out
    if len(paths) > 1 and (args.output is not None or args.stdout):
        raise _Usage("-o/-c name one output; give one PATH (several PATHs get default names)")
    if stdin and len(paths) > 1:
        raise _Usage("-: standard input must be the only PATH")
    if args.rm and (stdin or to_stdout):
        raise _Usage("--rm needs a PATH and an output file (not standard input/output)")
    if to_stdout and sys.stdout.isatty() and not args.force:
        raise _Usage("refusing to write binary data to a terminal; redirect it, use -o, "
                     "or --force")
    return to_stdout


def _code(args: argparse.Namespace, verb: str) -> int:
    """compress or decompress every PATH; an input that fails is reported and the others
    still run; the exit code is the worst one."""
    to_stdout = _check_plan(args)
    worst = EXIT_OK
    for path in args.path:
        _raise_caught()
        try:
            _code_one(args, verb, path, to_stdout)
        except (_Usage, FileExistsError, files.OutputRefused) as e:
            _raise_caught()
            _error(e)
            worst = max(worst, EXIT_USAGE)
        except BrokenPipeError:
            raise
        except (ValueError, OSError) as e:  # CorruptDataError is a ValueError
            _raise_caught()
            _error(e)
            worst = max(worst, EXIT_DATA)
    return worst


def _code_one(args: argparse.Namespace, verb: str, path: str, to_stdout: bool) -> None:
    compress = verb == "compress"
    stream = _atomic.Stream(sys.stdout.buffer) if to_stdout else None
    if path == "-":
        dst = stream if stream is not None else Path(args.output)
        fn = files.compress_as if compress else files.decompress_as
        with _stdin_spool() as spool:
            s = _with_bar(args, f"{verb} <stdin>", lambda bar: fn(
                spool, dst, "<stdin>", threads=args.threads, force=args.force,
                progress=bar, **_options(args, compress)))
        _report(args, verb, s, "<stdin>", dst, sys.stderr if to_stdout else None)
        return
    src = _existing(path)
    if src.is_dir():
        if to_stdout:
            raise _Usage(f"{src}: a directory cannot be written to standard output")
        if args.rm:
            raise _Usage(f"{src}: --rm removes files only, not directories")
    default = args.output is None and stream is None
    dst = stream or (files.default_output(src, compress) if default else Path(args.output))
    if isinstance(dst, Path) and not dst.parent.is_dir():
        raise _Usage(f"{dst}: output directory {dst.parent} does not exist")
    if src.is_dir():
        fn = checkpoint.compress_dir if compress else checkpoint.decompress_dir
        s = _with_bar(args, f"{verb} {src.name}", lambda bar: fn(
            src, dst, threads=args.threads, force=args.force, progress=bar,
            **_options(args, compress)))
    else:
        fn = files.compress_as if compress else files.decompress_as
        s = _with_bar(args, f"{verb} {src.name}", lambda bar: fn(
            src, dst, src, threads=args.threads, force=args.force, progress=bar,
            **_options(args, compress)))
    _report(args, verb, s, src, dst, sys.stderr if to_stdout else None)
    if args.verbose and src.is_dir() and not args.quiet:
        _per_file(src, dst)
    if compress and default and not src.is_dir() and files.default_output(dst, False) != src:
        warnings.warn(f"{dst}: decompresses to {files.default_output(dst, False).name} by "
                      f"default, not {src.name} (give -o then)", stacklevel=1)
    if args.rm:
        original, packed = (src, dst) if compress else (dst, src)
        files.verify_file(packed, original, threads=args.threads)
        _raise_caught()  # an interrupted run keeps its input
        src.unlink()
        if args.verbose and not args.quiet:
            print(f"removed {src} (its output {dst} verified against it)", file=sys.stderr)


def _options(args: argparse.Namespace, compress: bool) -> dict[str, object]:
    return {"fast": args.fast, "target": args.target} if compress else {}


def _with_bar(args: argparse.Namespace, label: str, work: Callable) -> Summary:
    bar = _progress(args, label)
    try:
        return work(_Checked(bar))
    finally:
        if bar is not None:
            bar.close()


def _per_file(src: Path, dst: object) -> None:
    """-v for a directory: each safetensors file's size before and after."""
    rows = [["file", "MB in", "MB out", "ratio"]]
    for rel in checkpoint.scan(src).safetensors:
        a, b = (src / rel).stat().st_size, (Path(str(dst)) / rel).stat().st_size
        rows.append([str(rel), _fmt_bytes(a), _fmt_bytes(b), f"{b / a if a else 1:.4f}"])
    print(_table(rows))


def _compress(args: argparse.Namespace) -> int:
    return _code(args, "compress")


def _decompress(args: argparse.Namespace) -> int:
    return _code(args, "decompress")


def _verify(args: argparse.Namespace) -> int:
    path = _existing(args.path)
    against = _existing(args.against) if args.against else None
    if against is not None and against.is_dir() != path.is_dir():
        raise _Usage(f"{against}: --against must be a {'directory' if path.is_dir() else 'file'}"
                     f" like {path}")
    fn = checkpoint.verify_dir if path.is_dir() else files.verify_file
    s = _with_bar(args, f"verify {path.name}",
                  lambda bar: fn(path, against, threads=args.threads, progress=bar))
    _report(args, "verify", s, path, None)
    what = f"restores {against} byte for byte" if against else "every checksum matches"
    if not args.quiet:
        print(f"OK: {path}: {what}")
    return EXIT_OK


def _info_file(path: Path) -> None:
    with files.named(path), files.opened(path) as f:
        h = read_header(f)
        if not is_compressed(h):
            rows = [["tensor", "dtype", "shape", "MB"]]
            rows += [[e.name, e.dtype, str(list(e.shape)), _fmt_bytes(e.nbytes)]
                     for e in h.by_offset]
            print(_table(rows))
            print(f"\n{path}: safetensors, not compressed: {len(h.entries)} tensors, "
                  f"{_fmt_bytes(f.size)} MB")
            return
        c = Compressed(f)
        rows = [["tensor", "dtype", "shape", "layout", "codecs", "MB in", "MB out", "ratio"]]
        for name in c.keys():
            e, t = c.entry(name), c.record.tensors[name]
            codecs = sorted({x for seg in t.codecs for x in seg})
            size = c.payload_size(name)
            rows.append([name, e.dtype, str(list(e.shape)), t.layout or "-",
                         ",".join(codecs) or "-", _fmt_bytes(e.nbytes), _fmt_bytes(size),
                         f"{size / e.nbytes:.4f}" if e.nbytes else "-"])
        print(_table(rows))
        meta = c.original.metadata or {}
        orig = c.original.file_size()
        print(f"\n{path}: entropykit record v{c.record.version}, {len(c.keys())} tensors, "
              f"{_fmt_bytes(orig)} MB -> {_fmt_bytes(f.size)} MB "
              f"(ratio {f.size / orig if orig else 1:.4f}), "
              f"segments of {c.record.segment_bytes:,} bytes, metadata {meta}")


def _info(args: argparse.Namespace) -> int:
    for i, name in enumerate(args.path):
        if i:
            print()
        path = _existing(name)
        if path.is_dir():
            for rel in checkpoint.inputs(path).safetensors:
                _info_file(path / rel)
                print()
        else:
            _info_file(path)
    return EXIT_OK


def _threads(text: str) -> int:
    try:
        return resolve(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="entropykit", epilog=_CODES,
        description="Lossless compression of safetensors model weights. A compressed file "
                    "is itself a valid safetensors file; decompress restores the original "
                    "byte for byte.")
    p.add_argument("--version", action="version", version=f"entropykit {__version__}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, helptext: str, fn: Callable) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=helptext, description=helptext, epilog=_CODES)
        sp.set_defaults(func=fn)
        return sp

    def threads_and_quiet(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--threads", type=_threads, default=None, metavar="N",
                        help="worker threads (default: $ENTROPYKIT_THREADS, else every "
                             "available core)")
        sp.add_argument("-q", "--quiet", action="store_true",
                        help="print nothing on success (errors and warnings still go to "
                             "stderr); no progress line")

    def coding(sp: argparse.ArgumentParser, default_names: str) -> None:
        sp.add_argument("path", metavar="PATH", nargs="+",
                        help="files or directories; - reads standard input (copied to an "
                             "unnamed temporary file in $TMPDIR first: it needs that much "
                             "space)")
        sp.add_argument("-o", "--output", metavar="OUT",
                        help=f"output path for one PATH; - is standard output (default: "
                             f"{default_names})")
        sp.add_argument("-c", "--stdout", action="store_true",
                        help="write to standard output (the summary then goes to stderr)")
        sp.add_argument("--force", action="store_true", help=_FORCE)
        keep = sp.add_mutually_exclusive_group()
        keep.add_argument("--rm", action="store_true",
                          help="remove each input file once its output is written and "
                               "decoded and compared with it byte for byte (files only)")
        keep.add_argument("--keep", action="store_true",
                          help="keep the input (the default; for gzip-style scripts)")
        sp.add_argument("-v", "--verbose", action="store_true",
                        help="for a directory also a table of its files' sizes; with --rm "
                             "say what was removed")
        threads_and_quiet(sp)

    c = verb("compress", "Compress safetensors files or checkpoint directories (every "
             "*.safetensors compressed under its own name, other files copied).", _compress)
    coding(c, "NAME.ek.safetensors for NAME.safetensors or NAME, DIR.ek for DIR; - in, "
              "- out")
    c.add_argument("--fast", action="store_true",
                   help="store fields that would shrink by under 2%% raw: faster to "
                        "compress and decompress, files slightly larger")
    c.add_argument("--target", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: rANS without contexts or row/column classes, in GPU-sized "
                        "chunks (the GPU kernel's fastest builds; both targets decode on "
                        "the GPU)")

    d = verb("decompress", "Restore the original files or directories, byte for byte.",
             _decompress)
    coding(d, "NAME.safetensors for NAME.ek.safetensors (NAME itself when it ends in .bin, "
              ".pt, .pth, .ckpt, .dat, .raw or .weights), DIR for DIR.ek; - in, - out")

    v = verb("verify", "Decode everything and check every checksum; with --against, also "
             "check that it restores ORIGINAL byte for byte.", _verify)
    v.add_argument("path", metavar="PATH")
    v.add_argument("--against", metavar="ORIGINAL", help="the original file or directory")
    threads_and_quiet(v)

    i = verb("info", "Show the tensors of a file (compressed or not): dtype, shape, "
             "layout, codecs, sizes and ratios. Decodes nothing.", _info)
    i.add_argument("path", metavar="PATH", nargs="+")
    # Listed for --help only: main() hands "analyze ..." to entropykit.analysis.cli.
    sub.add_parser("analyze", add_help=False,
                   help="Entropy analysis: how much PATH could shrink and where the wasted "
                        "bits are (entropykit analyze --help).")
    return p


# An output's temporary (``_atomic``): ``DIR/.NAME.XXXXXXXX.ek-tmp`` is shown as DIR/NAME.
_TEMP = re.compile(r"(^|/)\.([^/]+)\.[a-z0-9_]{8}" + re.escape(_atomic.TEMP_SUFFIX) + r"\b")


def _one_line(e: BaseException) -> str:
    """The error as one line, naming the user's files: an output's temporary never shows."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = " ".join(str(e).split("\n"))
    return _TEMP.sub(r"\1\2", text)


def _error(e: BaseException) -> None:
    print(f"entropykit: error: {_one_line(e)}", file=sys.stderr)


def _pipe_closed() -> int:
    """The reader of stdout went away (``entropykit info F | head``): stop quietly with
    128 + SIGPIPE, as a tool killed by SIGPIPE reports; later writes (Python's own flush at
    exit) go to /dev/null instead of raising again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["analyze"]:
            from .analysis import cli as analysis_cli

            return analysis_cli.main(argv[1:])
        return _main(_parser().parse_args(argv))
    except BrokenPipeError:
        return _pipe_closed()


def _main(args: argparse.Namespace) -> int:
    with _signals():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = _warn
                code = args.func(args)
                sys.stdout.flush()  # a closed pipe shows here, not at exit
        except BaseException:
            _raise_caught()  # whatever the error became, a signal is why the run stopped
            raise
        _raise_caught()  # never exit 0 after a signal
        return code
    except BrokenPipeError:
        raise
    except (_Usage, FileExistsError, files.OutputRefused) as e:
        _error(e)
        return EXIT_USAGE
    except (ValueError, OSError) as e:  # CorruptDataError is a ValueError
        _error(e)
        return EXIT_DATA
    except KeyboardInterrupt:
        print("entropykit: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except _Signalled as e:
        print(f"entropykit: terminated by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum


def _warn(message: Warning | str, *args: object, **kwargs: object) -> None:
    """A library warning (e.g. files skipped in a directory) as one line on stderr."""
    print(f"entropykit: warning: {message}", file=sys.stderr)


# The signal the handler raised for, kept: its raise may be lost where the main thread
# happened to be (a finalizer or __del__ prints and drops it, a C extension may clear
# it), and the handler, now ignoring the signals, will not raise again.
_caught: list[int] = []


def _raise_caught() -> None:
    """Raise ``_Signalled`` if a signal came: called at safe points (each segment and file,
    before an output is published, before the run reports success)."""
    if _caught and threading.current_thread() is threading.main_thread():
        raise _Signalled(_caught[0])


class _Checked:
    """A progress callback (around ``bar``, if any) that is also such a safe point."""

    def __init__(self, bar: Bar | None) -> None:
        self.bar = bar

    def __call__(self, done: int, total: int) -> None:
        _raise_caught()
        if self.bar is not None:
            self.bar(done, total)

    def start_file(self, name: str, size: int) -> None:
        _raise_caught()
        start = getattr(self.bar, "start_file", None)
        if start is not None:
            start(name, size)


@contextmanager
def _signals() -> Iterator[None]:
    """Make SIGHUP and SIGTERM unwind like SIGINT (once: a second one during the clean-up
    is ignored, so the clean-up finishes), unless already ignored; the handlers are
    restored when the block exits."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are delivered to the main thread only
        return
    saved: dict[int, object] = {}

    def handler(signum: int, frame: object) -> None:
        for s in saved:
            signal.signal(s, signal.SIG_IGN)
        _caught.append(signum)
        raise _Signalled(signum)

    def unraisable(u: sys.UnraisableHookArgs) -> None:
        # The handler's own raise is kept in _caught; after it, the finalizers of objects
        # it left half-built (an extension's) may fail too: the one line says why.
        if not _caught:
            hook(u)

    _caught.clear()
    hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        for name in _SIGNALS:
            signum = getattr(signal, name)
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's choice stands
                saved[signum] = signal.signal(signum, handler)
        with _atomic.publish_check(_raise_caught):
            yield
    finally:
        for signum, old in saved.items():
            signal.signal(signum, old)
        sys.unraisablehook = hook


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
