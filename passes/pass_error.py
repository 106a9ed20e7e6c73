"""``PassError`` and ``source_line``: what a pass's error says (the node and the user's
``file:line``, read from ``node.meta``). Imports neither torch nor sympy: a re-plan from the
layer-table cache raises it (``passes.compiled_table``) with neither loaded."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["PassError", "source_line"]


class PassError(ValueError):
    """A pass met a graph it cannot analyze, or a layer table was asked for what it cannot give;
    the message names the node and the source line where there is one."""

    def __init__(self, pass_name: str, node: Any | None, message: str):
        where = ""
        if not pass_name:  # a plain message (no pass, no node)
            self.text = message
            super().__init__(message)
            return
        if node is not None:
            where = f" at node {node.name!r} ({node.target})"
            src = source_line(node)
            if src:
                where += f", from {src}"
        self.text = f"{pass_name}{where}: {message}"
        super().__init__(self.text)

    def __str__(self) -> str:
        # the message as the pass wrote it: torch.fx's Interpreter appends the graph node, the
        # traced stack and a pointer to its log parser to the args of whatever a node raises
        return getattr(self, "text", None) or super().__str__()


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def source_line(node: Any) -> str:
    """``file:line`` of the innermost user frame that created an ``fx.Node`` ('' if unknown)."""
    trace = node.meta.get("stack_trace") or ""
    hits = _FILE_LINE.findall(trace)
    if not hits:
        return ""
    path, line = hits[-1]
    return f"{path}:{line}"
