"""The command line's flag groups, as vLLM groups its flags, and a --help that shows each flag's default once.

Whoever adds flags (launch.py, common/config.py: add_engine_args, frontend/limits.py: add_http_limit_args) adds
each to its group with `flag_group(parser, MODEL).add_argument(...)`; launch.py makes the groups first, in this
order, and --help lists them so, whichever file adds to them.
"""

from __future__ import annotations

import argparse

MODEL = "model"
PARALLEL = "parallel"
NODES = "nodes"
CACHE = "cache"
SCHEDULER = "scheduler"
FRONTEND = "frontend"
LIMITS = "limits"
OBSERVABILITY = "observability"

GROUPS = {
    MODEL: "what is served and how it is loaded",
    PARALLEL: "processes, replicas and cores",
    NODES: "data-parallel replicas on other hosts (docs/deployment.md)",
    CACHE: "the KV store and its prefix cache",
    SCHEDULER: "batching and admission",
    FRONTEND: "HTTP and the OpenAI API",
    LIMITS: "per request and per connection",
    OBSERVABILITY: "logs, profiles and liveness",
}


def add_flag_groups(parser: argparse.ArgumentParser) -> None:
    """Make every group, in --help's order."""
    for title, description in GROUPS.items():
        flag_group(parser, title, description)


def flag_group(parser: argparse.ArgumentParser, title: str, description: str | None = None) -> argparse._ArgumentGroup:
    """The parser's group `title`, made where it has none yet (a benchmark's own parser takes the engine's flags
    without launch.py's groups)."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, description or GROUPS.get(title))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after a flag's help, unless the help states its default itself ("default: ...",
    for a default that is not a value, such as "sized from free memory"): one default per flag, never
    "(default: None)" beside the words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if "default:" in help or "%(default)" in help:
            return help
        return super()._get_help_string(action)
