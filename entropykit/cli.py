"""The ``entropykit`` command: compress, decompress, verify and inspect safetensors files.

What it is: argument parsing, a progress line on stderr (when it is a terminal), the
summary table on stdout, and exit codes scripts can rely on:

    0  success
    1  bad data: a corrupt, truncated or non-safetensors input, an unsupported dtype,
       a missing shard, a verify mismatch, or an I/O error
    2  bad usage: wrong arguments, a PATH that does not exist, an output that exists
       (without --force), an output that is, contains or lies inside the input, or one
       that may not be replaced (a directory where a file goes, a device, a socket)
    128+N  killed by signal N: SIGINT (130), SIGHUP (129) or SIGTERM (143)

Errors are one line on stderr naming the file and the problem; no partial output is left,
whether the run fails or is interrupted by one of those signals.
What it is not: the work itself (``entropykit.api`` and ``entropykit.container``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from . import __version__
from .container import checkpoint, files
from .container.parallel import resolve
from .container.progress import Bar
from .container.reader import Compressed, is_compressed, read_header
from .container.stats import Row, Summary

EXIT_OK, EXIT_DATA, EXIT_USAGE = 0, 1, 2
_CODES = """exit codes: 0 success; 1 corrupt/unsupported input, verify mismatch or I/O error;
2 bad usage (arguments, missing PATH, existing output without --force, output overlapping
the input or not replaceable); 130/129/143 interrupted by SIGINT/SIGHUP/SIGTERM (nothing
left behind)"""
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


def _summary_table(s: Summary, bound: bool) -> str:
    head = ["dtype", "tensors", "values", "MB in", "MB out", "ratio", "bits/value"]
    if bound:
        head.append("order-0 bound")

    def line(name: str, r: Row) -> list[str]:
        cells = [name, f"{r.tensors:,}", f"{r.values:,}", _fmt_bytes(r.bytes_in),
                 _fmt_bytes(r.bytes_out), f"{r.ratio:.4f}", f"{r.bits_per_value:.3f}"]
        if bound:
            cells.append(f"{r.bound_per_value:.3f}")
        return cells

    rows = [head] + [line(k, r) for k, r in sorted(s.rows.items())]
    if len(s.rows) > 1:
        rows.append(line("total", s.total))
    return _table(rows)


def _report(verb: str, s: Summary, bound: bool, src: Path, dst: Path | None) -> None:
    """The table, then one line; MB/s are of original bytes, whatever the direction."""
    print(_summary_table(s, bound))
    original, packed = (s.original_bytes, s.compressed_bytes)
    n = f"{s.files} file{'s' if s.files != 1 else ''}"
    where = f" -> {dst}" if dst is not None else ""
    print(f"\n{verb} {src}{where}: {n}, original {_fmt_bytes(original)} MB, compressed "
          f"{_fmt_bytes(packed)} MB, ratio {s.ratio:.4f}, {s.seconds:.2f} s, "
          f"{s.mb_per_s(original):,.1f} MB/s")


def _progress(args: argparse.Namespace, label: str) -> Bar | None:
    if args.quiet or not sys.stderr.isatty():
        return None
    return Bar(label)


def _existing(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise _Usage(f"{p}: no such file or directory")
    return p


def _run(args: argparse.Namespace, on_file: Callable, on_dir: Callable, verb: str,
         default: bool, **options: object) -> tuple[Summary, Path]:
    src = _existing(args.path)
    dst = Path(args.output) if args.output else files.default_output(src, default)
    if not dst.parent.is_dir():
        raise _Usage(f"{dst}: output directory {dst.parent} does not exist")
    bar = _progress(args, f"{verb} {src.name}")
    try:
        fn = on_dir if src.is_dir() else on_file
        return fn(src, dst, threads=args.threads, force=args.force, progress=bar,
                  **options), dst
    finally:
        if bar is not None:
            bar.close()


def _compress(args: argparse.Namespace) -> int:
    s, dst = _run(args, files.compress_file, checkpoint.compress_dir, "compress", True,
                  fast=args.fast, target=args.target)
    _report("compress", s, True, Path(args.path), dst)
    return EXIT_OK


def _decompress(args: argparse.Namespace) -> int:
    s, dst = _run(args, files.decompress_file, checkpoint.decompress_dir, "decompress", False)
    _report("decompress", s, False, Path(args.path), dst)
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    path = _existing(args.path)
    against = _existing(args.against) if args.against else None
    if against is not None and against.is_dir() != path.is_dir():
        raise _Usage(f"{against}: --against must be a {'directory' if path.is_dir() else 'file'}"
                     f" like {path}")
    bar = _progress(args, f"verify {path.name}")
    try:
        fn = checkpoint.verify_dir if path.is_dir() else files.verify_file
        s = fn(path, against, threads=args.threads, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    _report("verify", s, False, path, None)
    what = f"restores {against} byte for byte" if against else "every checksum matches"
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
        print(f"\n{path}: entropykit container v1, {len(c.keys())} tensors, "
              f"{_fmt_bytes(orig)} MB -> {_fmt_bytes(f.size)} MB "
              f"(ratio {f.size / orig if orig else 1:.4f}), "
              f"segments of {c.record.segment_bytes:,} bytes, metadata {meta}")


def _info(args: argparse.Namespace) -> int:
    path = _existing(args.path)
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
                        help="worker threads (default: every available core)")
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress line")

    c = verb("compress", "Compress a safetensors file or a checkpoint directory (every "
             "*.safetensors compressed under its own name, other files copied).", _compress)
    c.add_argument("path", metavar="PATH")
    c.add_argument("-o", "--output", metavar="OUT",
                   help="output path (default: NAME.ek.safetensors, or DIR.ek)")
    c.add_argument("--force", action="store_true", help=_FORCE)
    c.add_argument("--fast", action="store_true",
                   help="store fields that would shrink by under 2%% raw: compress and "
                        "decompress ~1.5x faster, files ~0.5-1%% larger")
    c.add_argument("--target", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: rANS only, in GPU-sized chunks, so that "
                        "load_file(..., device='cuda') decodes everything on the GPU")
    c.add_argument("--keep", action="store_true",
                   help="keep the input (always: entropykit never deletes or modifies its "
                        "input; accepted for gzip-style scripts)")
    threads_and_quiet(c)

    d = verb("decompress", "Restore the original file or directory, byte for byte.",
             _decompress)
    d.add_argument("path", metavar="PATH")
    d.add_argument("-o", "--output", metavar="OUT",
                   help="output path (default: the name without .ek, or "
                        "NAME.restored.safetensors)")
    d.add_argument("--force", action="store_true", help=_FORCE)
    threads_and_quiet(d)

    v = verb("verify", "Decode everything and check every checksum; with --against, also "
             "check that it restores ORIGINAL byte for byte.", _verify)
    v.add_argument("path", metavar="PATH")
    v.add_argument("--against", metavar="ORIGINAL", help="the original file or directory")
    threads_and_quiet(v)

    i = verb("info", "Show the tensors of a file (compressed or not): dtype, shape, "
             "layout, codecs, sizes and ratios. Decodes nothing.", _info)
    i.add_argument("path", metavar="PATH")
    # Listed for --help only: main() hands "analyze ..." to entropykit.analysis.cli.
    sub.add_parser("analyze", add_help=False,
                   help="Entropy analysis: how much PATH could shrink and where the wasted "
                        "bits are (entropykit analyze --help).")
    return p


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split("\n"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["analyze"]:
        from .analysis import cli as analysis_cli

        return analysis_cli.main(argv[1:])
    args = _parser().parse_args(argv)
    saved = _on_signals()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = _warn
            return args.func(args)
    except (_Usage, FileExistsError, files.OutputRefused) as e:
        print(f"entropykit: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError) as e:  # CorruptDataError is a ValueError
        print(f"entropykit: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_DATA
    except KeyboardInterrupt:
        print("entropykit: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except _Signalled as e:
        print(f"entropykit: terminated by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _warn(message: Warning | str, *args: object, **kwargs: object) -> None:
    """A library warning (e.g. files skipped in a directory) as one line on stderr."""
    print(f"entropykit: warning: {message}", file=sys.stderr)


def _on_signals() -> dict[int, object]:
    """Make SIGHUP and SIGTERM unwind like SIGINT (once: a second one during the clean-up
    is ignored, so the clean-up finishes), unless already ignored; returns the handlers
    to restore."""
    saved: dict[int, object] = {}
    if threading.current_thread() is not threading.main_thread():
        return saved  # signals are delivered to the main thread only

    def handler(signum: int, frame: object) -> None:
        for s in saved:
            signal.signal(s, signal.SIG_IGN)
        raise _Signalled(signum)

    for name in _SIGNALS:
        signum = getattr(signal, name)
        if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's choice stands
            saved[signum] = signal.signal(signum, handler)
    return saved


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
