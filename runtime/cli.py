"""`tokenfleet` console script: dispatches a subcommand to its component's `main(argv) -> int`.

Imports are lazy so `tokenfleet operator` never imports torch, and a missing optional part fails only the
subcommand that needs it.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tokenfleet.runtime.server.main", "run the OpenAI-compatible runtime server"),
    "generate": ("tokenfleet.runtime.generate_cli", "generate text offline and stream it to the terminal"),
    "route": ("tokenfleet.runtime.router.main", "run the cache-aware router"),
    "operator": ("tokenfleet.operator.main", "run the Kubernetes operator (kopf)"),
    "simulate": ("tokenfleet.sim.cli", "simulate a fleet on a virtual clock; plan capacity"),
    "fetch": ("tokenfleet.runtime.model.fetch_cli", "download an hf:// model into a verified cache"),
}


def _usage() -> str:
    lines = ["usage: tokenfleet <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`tokenfleet <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from tokenfleet import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"tokenfleet: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
