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


def readme_block(marker: str, lang: str = "python") -> str:
    """The README's first fenced `lang` block that contains `marker`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for block in re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S):
        if marker in block:
            return str(block)
    raise AssertionError(f"no ```{lang} block with {marker!r} in README.md")


def test_readme_typed_client_example_runs_as_written(tmp_path: Path) -> None:
    """The README's typed-client example, run unchanged (but for the port) by the venv's
    python against `pgreserve up` with a tenant made as the README says, claims 2 of 50
    and prints the stock line the README shows."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from test_cli import running_up
    from test_cli_up import BIN, free_port

    example = readme_block("pgreserve.client")
    port = free_port()
    assert example.count("http://127.0.0.1:8000") == 1
    script = tmp_path / "example.py"
    script.write_text(example.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = re.search(r"[Ii]t prints `(Stock\(.*?\))`", text)
    assert shown is not None
    work = Path(tempfile.mkdtemp(prefix="pgr-"))  # `make run` runs up in the checkout
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGRESERVE_")}
    try:
        with running_up("--port", str(port), cwd=work):
            made = subprocess.run([str(BIN), "tenant", "create", "shop", "--json"], cwd=work,
                                  env=env, capture_output=True, text=True, timeout=120,
                                  check=True)
            env["KEY"] = json.loads(made.stdout)["api_key"]
            ran = subprocess.run([sys.executable, str(script)], cwd=work, env=env,
                                 capture_output=True, text=True, timeout=120, check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == shown.group(1)
