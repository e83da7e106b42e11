"""``entropykit analyze PATH``: the analysis on the command line.

What it is: ``main(argv) -> exit code``: parse the arguments, run ``analyze`` with a
progress line on stderr (when it is a terminal), print the table on stdout (fitting 100
columns unless ``--wide``; nothing with ``-q``), and write the JSON report (atomically,
like every entropykit output) and the plot when asked. Exit codes follow
``entropykit.cli``: 0 success, 1 bad data (corrupt or unsupported input, I/O error), 2
bad usage (missing PATH, a --json output that exists without --force, a plot suffix
other than .png/.html, matplotlib missing for --plot). What it is not: the analysis
itself (``analyze``, ``report``, ``plots``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..container import _atomic
from ..container.progress import Bar
from .analyze import analyze

EXIT_OK, EXIT_DATA, EXIT_USAGE = 0, 1, 2
COLUMNS = 100  # the default table's width


def parser(prog: str = "entropykit analyze") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="How much could PATH shrink, and where are the wasted bits? Per tensor "
                    "and per field (the streams entropykit codes): order-0 and conditional "
                    "entropy, bits carried vs allocated, the bound on the compression "
                    "ratio, aggregates per dtype and role. PATH is a safetensors file, a "
                    "checkpoint directory, or an entropykit-compressed file (then the "
                    "table also shows what entropykit achieved against the bound).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", metavar="OUT", help="write the full report as JSON to OUT "
                   "(complete or not at all; an existing OUT only with --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --json OUT")
    p.add_argument("--wide", action="store_true",
                   help=f"every column (the per-field entropies) and full names; by "
                        f"default the table fits {COLUMNS} columns")
    p.add_argument("--plot", metavar="OUT", help="write plots to OUT (.png, or .html: the "
                   "figure and the table in one page); needs matplotlib")
    p.add_argument("--top", type=int, default=20, metavar="N",
                   help="tensors listed in the table, largest first (default 20; 0: all)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print nothing on success (no table, no progress line; errors "
                        "still go to stderr): for --json / --plot runs")
    return p


def _fail(code: int, msg: str) -> int:
    print(f"entropykit: error: {' '.join(msg.split())}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``entropykit analyze``; returns the exit code."""
    args = parser().parse_args(argv)
    path = Path(args.path)
    if not path.exists():
        return _fail(EXIT_USAGE, f"{path}: no such file or directory")
    if args.top < 0:
        return _fail(EXIT_USAGE, f"--top must be >= 0, got {args.top}")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".html", ".htm"):
        return _fail(EXIT_USAGE, f"{args.plot}: --plot output must end in .png or .html")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before the work, not after)
        except ImportError:
            return _fail(EXIT_USAGE, "--plot needs matplotlib: pip install 'entropykit[plots]'")
    if args.json:
        try:  # before the work, not after
            _atomic.check_target(Path(args.json), args.force)
        except (FileExistsError, FileNotFoundError, _atomic.OutputRefused) as e:
            return _fail(EXIT_USAGE, str(e))
    bar = None if args.quiet or not sys.stderr.isatty() else Bar(f"analyze {path.name}")
    try:
        try:
            rep = analyze(path, progress=bar)
        finally:
            if bar is not None:
                bar.close()
        if not args.quiet:
            print(rep.to_table(args.top or None, None if args.wide else COLUMNS))
        if args.json:
            with _atomic.output_file(Path(args.json), args.force) as out:
                out.write((rep.to_json() + "\n").encode("utf-8"))
        if args.plot:
            from .plots import plot

            plot(rep, args.plot, top=args.top or None)
    except (FileExistsError, _atomic.OutputRefused) as e:
        return _fail(EXIT_USAGE, str(e))
    except BrokenPipeError:
        raise
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        return _fail(EXIT_DATA, f"{where}{e.strerror or e}")
    except ValueError as e:  # CorruptDataError is a ValueError
        return _fail(EXIT_DATA, str(e))
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
