"""``python -m grace_dl`` / ``grace-dl``: command-line tools.

    grace-dl strategy build|show|validate ...   (see grace_dl.strategy.cli)
"""

from __future__ import annotations

import sys

COMMANDS = {"strategy": "grace_dl.strategy.cli"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: grace-dl {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown command {argv[0]!r}; accepted: {sorted(COMMANDS)}",
                  file=sys.stderr)
            return 2
        return 0 if argv else 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
