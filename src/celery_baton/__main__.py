"""``python -m celery_baton demo`` runs the demo; ``--version`` says which celery-baton
is installed; ``--help`` explains."""

from __future__ import annotations

import argparse
import sys

from celery_baton import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m celery_baton",
        description="celery-baton: coordination for Celery. Commands for one machine; "
        "the operator's commands are `celery -A proj baton ...`.",
    )
    parser.add_argument("--version", action="version", version=f"celery-baton {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run the whole system on the embedded store and check every guarantee",
        description="Starts the embedded Valkey (store and broker), 2 workers and 2 beat "
        "processes as real processes, runs one scenario per capability, prints a table of "
        "what was measured and exits non-zero if a guarantee failed. Ctrl-C stops every "
        "process it started.",
    )
    demo.add_argument(
        "--keep-store", action="store_true", help="leave the embedded server running afterwards"
    )
    sub.add_parser(
        "stop-embedded",
        help="stop the shared embedded Valkey server",
        description="Stops this user's embedded Valkey server (its data stays on disk). "
        "A worker or beat still using it starts it again when it next needs it: stop "
        "them first to stop it for good.",
    )
    given = sys.argv[1:] if argv is None else argv
    if given and given[0] not in sub.choices and not given[0].startswith("-"):
        # An operator's command (status, locks, cancel...) tried here: say where it is.
        parser.error(
            f"no command {given[0]!r} here (this runs: {', '.join(sub.choices)}); the "
            f"operator's commands read your app's settings: `celery -A proj baton {given[0]}`"
        )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from celery_baton.demo.run import main as demo_main

        return demo_main(keep_store=args.keep_store)
    from celery_baton.store.connection import stop_embedded_server

    print("stopped" if stop_embedded_server() else "not running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
