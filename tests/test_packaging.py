"""What pyproject.toml declares matches what the code imports."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "pgreserve"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _names(requirements: list[str]) -> set[str]:
    """Normalised distribution names of requirement strings (`psycopg[binary]>=3` -> psycopg)."""
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower().replace("_", "-")
            for r in requirements}


def _third_party_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "pgreserve"}


def test_every_import_of_the_package_is_declared() -> None:
    """Each third-party module src/pgreserve imports comes from a runtime dependency,
    or, under bench/, from a runtime dependency or the bench extra."""
    runtime = _names(PROJECT["dependencies"])
    bench = runtime | _names(PROJECT["optional-dependencies"]["bench"])
    dists = packages_distributions()
    undeclared = []
    for path in sorted(SRC.rglob("*.py")):
        allowed = bench if "bench" in path.relative_to(SRC).parts else runtime
        for module in sorted(_third_party_imports(path)):
            provided = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
            if not provided & allowed:
                undeclared.append(f"{path.relative_to(SRC)}: {module}")
    assert undeclared == []


def test_the_benchmark_libraries_are_not_runtime_dependencies() -> None:
    """hdrhistogram and matplotlib are in the bench extra only."""
    assert {"hdrhistogram", "matplotlib"} <= _names(PROJECT["optional-dependencies"]["bench"])
    assert not {"hdrhistogram", "matplotlib"} & _names(PROJECT["dependencies"])


def test_bench_without_its_extra_says_what_to_install() -> None:
    """With the bench extra's modules missing, the CLI still loads and `pgreserve bench`
    exits 1 naming `pgreserve[bench]`, without a traceback."""
    code = ("import sys; sys.modules['hdrh'] = None; sys.modules['matplotlib'] = None\n"
            "from pgreserve.cli import main\n"
            "main(['bench', 'flash-sale', '--quiet'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 1
    assert "pip install 'pgreserve[bench]'" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_license_file_matches_pyproject() -> None:
    """pyproject's licence is the SPDX id Apache-2.0 and LICENSE holds that licence's text."""
    assert PROJECT["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
