"""``python -m grace_dl`` / ``grace-dl``: command-line tools.

    grace-dl strategy build|show|validate ...   (see grace_dl.strategy.cli)
"""

from __future__ import annotations

import sys

COMMANDS = {"strategy": "grace_dl.strategy.cli"}
#: what each command does, for ``--help``
ABOUT = {"strategy": "build, show, validate or measure a per-variable strategy "
                     "(grace-dl strategy --help)"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: grace-dl {{{','.join(COMMANDS)}}} ..."
    if argv and argv[0] in ("-h", "--help"):
        print("\n".join([usage, "", "commands:",
                          *(f"  {name:<10} {ABOUT[name]}" for name in COMMANDS)]))
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage, file=sys.stderr)
        if argv:
            print(f"error: unknown command {argv[0]!r}; accepted: {sorted(COMMANDS)}",
                  file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
