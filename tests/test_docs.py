"""The documents cite files and tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md"])
# where a path cited without its folder is looked up
BASES = [ROOT, ROOT / "tests", ROOT / "src" / "pgreserve", ROOT / "docs"]

CODE = re.compile(r"`([^`\n]+)`")
FILE = re.compile(r"^(?:\.\./)?([\w./-]+\.(?:py|sql|md|json|png|toml))(?:::(\w+))?$")
TEST_NAME = re.compile(r"^(test_\w+)(?:\[[^\]]*\])?$")
LINK = re.compile(r"\]\(([^)#\s]+\.(?:md|json|png))(?:#[^)]*)?\)")


def find(path: str) -> Path | None:
    for base in BASES:
        candidate = base / path
        if candidate.exists():
            return candidate
    return None


def defined_tests() -> set[str]:
    names: set[str] = set()
    for source in (ROOT / "tests").rglob("*.py"):
        names |= set(re.findall(r"^(?:async )?def (test_\w+)", source.read_text(), re.M))
    return names


def citations() -> list[tuple[Path, str]]:
    found: list[tuple[Path, str]] = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        found += [(doc, m) for m in CODE.findall(text)]
        found += [(doc, m) for m in LINK.findall(text)]
    return found


def test_every_cited_file_and_test_exists() -> None:
    """Every file path (`tests/x.py`, `sql/functions/y.sql`, a linked page) and every test
    (`file.py::test_name` or a bare `test_name`) cited in README.md or docs/ exists."""
    tests = defined_tests()
    missing: list[str] = []
    checked = 0
    for doc, cited in citations():
        where = doc.relative_to(ROOT)
        for part in (p.strip() for p in cited.split(",")):
            file_match = FILE.match(part)
            if file_match:
                path, test = file_match.groups()
                if "*" in path or path.startswith(("/", "~")) or "NNNN" in path:
                    continue
                target = find(path) if not doc.parent.joinpath(path).exists() \
                    else doc.parent / path
                checked += 1
                if target is None:
                    missing.append(f"{where}: {path}")
                elif test and not re.search(rf"^(?:async )?def {test}\b",
                                            target.read_text(), re.M):
                    missing.append(f"{where}: {path}::{test}")
                continue
            name_match = TEST_NAME.match(part)
            if name_match:
                checked += 1
                if name_match[1] not in tests:
                    missing.append(f"{where}: {name_match[1]}")
    assert checked > 50, "the scan found the citations"
    assert missing == []
