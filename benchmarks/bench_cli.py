"""The command line every benchmark script shares: one flag per field of its config dataclass
(``--no-NAME`` for a boolean that defaults to on), ``--json FILE`` for the whole result, the
report on stdout, the progress on stderr, and an exit status that says whether the targets were
met."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any, Callable, Sequence

__all__ = ["config_parser", "bench_main"]


def config_parser(config_class: type, doc: str | None) -> argparse.ArgumentParser:
    """A parser with a flag per field of ``config_class`` (its defaults) and ``--json``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    for name, default in asdict(config_class()).items():
        if isinstance(default, bool):
            parser.add_argument(f"--no-{name.replace('_', '-')}", dest=name, action="store_false")
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--json", help="write the result here")
    return parser


def bench_main(
    argv: Sequence[str] | None,
    config_class: type,
    doc: str | None,
    run: Callable[..., dict],
    report: Callable[[dict], str],
    passed: Callable[[dict], bool],
) -> int:
    """Parse ``argv``, ``run(config, log=...)``, print ``report(result)``, write ``--json``; 0 when
    ``passed(result)``, else 1."""
    args: dict[str, Any] = vars(config_parser(config_class, doc).parse_args(argv))
    out = args.pop("json")
    result = run(config_class(**args), log=lambda line: print(line, file=sys.stderr, flush=True))
    print(report(result))
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if passed(result) else 1
