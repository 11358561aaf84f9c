"""SQL lives in sql/queries/*.sql as named blocks; Python modules look it up by name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pgreserve.db.queries import Queries, parse, queries

SRC = Path(__file__).resolve().parents[1] / "src" / "pgreserve"
QUERY_DIR = SRC / "sql" / "queries"
LOADER = SRC / "db" / "queries.py"

# A string literal is SQL text when it starts (after blanks and opening
# parentheses) with an upper-case statement keyword.
SQL_START = re.compile(
    r"\A[\s(]*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP|BEGIN|COMMIT|ROLLBACK|SET"
    r"|SHOW|VACUUM|ANALYZE|TRUNCATE|LISTEN|NOTIFY|COPY|EXPLAIN)(?=[\s(;]|\Z)")
# An HTTP route, such as the static tag "DELETE /v1/webhooks/{id}", is not SQL.
HTTP_ROUTE = re.compile(r"\A(GET|POST|PUT|PATCH|DELETE) /")
QUERY_NAME_USE = re.compile(r"""queries\[\s*["']([a-z][a-z0-9_]*)["']\s*\]""")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the module, class and function docstring nodes of `tree`."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def sql_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal in `source` that starts like a SQL statement,
    f-strings included (their text up to the first placeholder), docstrings excepted."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    inside_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                       for v in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            text = head.value if isinstance(head, ast.Constant) else ""
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docs and id(node) not in inside_fstrings):
            text = node.value
        else:
            continue
        if isinstance(text, str) and SQL_START.match(text) and not HTTP_ROUTE.match(text):
            found.append((node.lineno, text))
    return found


def python_modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p != LOADER)


def test_the_scan_recognises_sql_text() -> None:
    """The scan finds SQL in plain, concatenated, triple-quoted and f-strings, and passes
    prose, docstrings and HTTP routes."""
    source = '''
def f(conn, key):
    """SELECT in a docstring is documentation."""
    conn.execute("SELECT 1")
    conn.execute("UPDATE t SET a = 1"
                 " WHERE b = 2")
    conn.execute("""
        WITH x AS (SELECT 1) SELECT * FROM x""")
    conn.execute(f"ALTER SYSTEM SET {key} = 'on'")
    conn.execute("(SELECT 1) UNION (SELECT 2)")
    tag = "DELETE /v1/webhooks/{id}"
    help_text = "Create a tenant and print its key"
    name = "create"
    '''
    found = [text.split()[0].strip("(") for _, text in sql_literals(source)]
    assert found == ["SELECT", "UPDATE", "WITH", "ALTER", "SELECT"]


def test_no_python_module_holds_sql_text() -> None:
    """Outside the query loader (and, for now, http/), no Python module under
    src/pgreserve holds a string literal that starts with a SQL statement keyword."""
    offenders = [f"{path.relative_to(SRC)}:{line}: {text.strip()[:60]!r}"
                 for path in python_modules()
                 for line, text in sql_literals(path.read_text(encoding="utf-8"))]
    assert offenders == [], "SQL text in Python (move it to sql/queries/):\n" + "\n".join(
        offenders)


def _used_names() -> set[str]:
    return {name for path in SRC.rglob("*.py")
            for name in QUERY_NAME_USE.findall(path.read_text(encoding="utf-8"))}


def test_every_query_name_used_exists() -> None:
    """Every `queries["..."]` in src/ names a block of sql/queries/."""
    assert sorted(_used_names() - set(queries)) == []


def test_every_query_block_is_used() -> None:
    """Every block of sql/queries/ is looked up somewhere in src/ as `queries["..."]`."""
    assert sorted(set(queries) - _used_names()) == []


def test_query_names_are_noun_then_verb() -> None:
    """Every block name is `<noun>_<verb>`: at least two lower-case words joined by `_`."""
    assert [n for n in queries if not re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", n)] == []


def test_loader_refuses_a_name_defined_twice_in_one_file() -> None:
    """parse() stops at the second block of one name, citing the line."""
    text = "-- name: bucket_view\nSELECT 1;\n\n-- name: bucket_view\nSELECT 2;\n"
    with pytest.raises(ValueError, match=r"x\.sql:4: query 'bucket_view' is defined twice"):
        parse(text, source="x.sql")


def test_loader_refuses_a_name_defined_in_two_files(tmp_path: Path) -> None:
    """Two query files defining one name make the first lookup fail."""
    (tmp_path / "a.sql").write_text("-- name: bucket_view\nSELECT 1;\n")
    (tmp_path / "b.sql").write_text("-- name: bucket_view\nSELECT 2;\n")
    with pytest.raises(ValueError, match="'bucket_view' is defined twice"):
        Queries(tmp_path)["bucket_view"]


def test_loader_drops_the_description_and_the_last_semicolon() -> None:
    """Comment lines right after a header describe the block; the statement runs to the
    next header without its trailing semicolon."""
    text = ("-- file header\n\n-- name: tenant_exists\n-- Is there such a tenant?\n"
            "SELECT 1\nFROM tenant;\n\n"
            "-- name: tenant_create\nINSERT INTO tenant DEFAULT VALUES;\n")
    assert parse(text) == {"tenant_exists": "SELECT 1\nFROM tenant",
                           "tenant_create": "INSERT INTO tenant DEFAULT VALUES"}


ORDER_BY = re.compile(r"\bORDER BY\b(.*)")
UNCOLLATED_NAME = re.compile(r"\b(?:\w+\.)?(sku|location)\b(?!\s+COLLATE \"C\")")


def test_every_function_orders_skus_and_locations_by_code_point() -> None:
    """Every ORDER BY of a function that sorts by sku or location says COLLATE "C": the
    lock order is (sku, location) in code-point order, as Python sorts a cart, also in a
    database whose default collation (en_US.UTF-8, ICU) sorts 'B1' after 'a1'."""
    found = []
    for path in sorted((SRC / "sql" / "functions").glob("*.sql")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = ORDER_BY.search(line.split("--")[0])
            if match and UNCOLLATED_NAME.search(match.group(1)):
                found.append(f"{path.name}:{number}: {line.strip()}")
    assert found == []
