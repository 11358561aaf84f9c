"""Named SQL blocks from `sql/queries/*.sql`, loaded once by name.

A block starts with a line `-- name: <noun>_<verb>`; comment lines right after
it describe the block and are not part of the statement. The statement runs to
the next block (a trailing semicolon is dropped, so a caller tag can follow
the last token). Python modules never hold SQL text of their own: they look
their statements up here, e.g. `queries["bucket_view"]`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from typing import LiteralString, cast

_HEADER = re.compile(r"^-- name: ([a-z][a-z0-9_]*)\s*$")


def parse(text: str, *, source: str = "<string>") -> dict[str, LiteralString]:
    """The named blocks of one query file's text."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    describing = False
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header:
            name = header[1]
            if name in blocks:
                raise ValueError(f"{source}:{number}: query {name!r} is defined twice")
            current = blocks[name] = []
            describing = True
            continue
        if current is None:
            continue  # the file's own header comment
        if describing and line.startswith("--"):
            continue
        describing = False
        current.append(line)
    out: dict[str, LiteralString] = {}
    for name, lines in blocks.items():
        statement = "\n".join(lines).strip().removesuffix(";").rstrip()
        if not statement:
            raise ValueError(f"{source}: query {name!r} is empty")
        # mypy reads LiteralString as str; the cast is for checkers that enforce it
        out[name] = cast(LiteralString, statement)  # type: ignore[redundant-cast]
    return out


class Queries(Mapping[str, LiteralString]):
    """Every named block of the query files in `folder` (default: the package's
    sql/queries/), read on first use."""

    def __init__(self, folder: Traversable | None = None) -> None:
        self._folder = folder
        self._blocks: dict[str, LiteralString] | None = None

    def _load(self) -> dict[str, LiteralString]:
        if self._blocks is None:
            blocks: dict[str, LiteralString] = {}
            folder = self._folder or resources.files("pgreserve") / "sql" / "queries"
            for entry in sorted(folder.iterdir(), key=lambda e: e.name):
                if not entry.name.endswith(".sql"):
                    continue
                for name, statement in parse(entry.read_text(encoding="utf-8"),
                                             source=entry.name).items():
                    if name in blocks:
                        raise ValueError(f"{entry.name}: query {name!r} is defined twice")
                    blocks[name] = statement
            self._blocks = blocks
        return self._blocks

    def __getitem__(self, name: str) -> LiteralString:
        try:
            return self._load()[name]
        except KeyError:
            raise KeyError(f"no query named {name!r} in sql/queries/") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


queries = Queries()
