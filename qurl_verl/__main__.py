"""``python -m qurl_verl <command>``: ``doctor`` checks this environment for a preset (``qurl_verl.doctor``)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from qurl_verl import doctor

    parser = argparse.ArgumentParser(prog="python -m qurl_verl")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor.add_arguments(commands.add_parser("doctor", help="check this environment for +qurl=<preset>, in seconds"))
    args = parser.parse_args(argv)
    return doctor.run(args.preset)


if __name__ == "__main__":
    sys.exit(main())
