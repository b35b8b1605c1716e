"""`python -m kvloom.server [MODEL] ...`: the same as `kvloom serve`."""

from __future__ import annotations

import argparse
import sys

from kvloom.server.cli import add_serve_parser, run_serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.server", allow_abbrev=False)
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_serve(args)
    except ValueError as error:
        print(f"kvloom: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
