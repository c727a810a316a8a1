"""``python -m apps.report outputs/<run_name> [...]``: write ``report.png`` and ``report.md`` into
each run folder (also while the run goes on)."""

from __future__ import annotations

import argparse
import sys

from apps.report.report import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apps.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (outputs/<run_name>)")
    args = parser.parse_args(argv)
    status = 0
    for folder in args.runs:
        try:
            png, md = write_report(folder)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 2
            continue
        print(f"report: {png} and {md}")
    return status


if __name__ == "__main__":
    sys.exit(main())
