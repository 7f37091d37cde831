"""DuckDB helpers shared by merge and aggregate: connections, the .sql files, Parquet in and out."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import duckdb

from vidlabel.core.io import atomic_path

SQL_DIR = Path(__file__).resolve().parents[1] / "sql"

# Question ids become SQL identifiers and column names; the config schema already restricts them
# to this pattern, and we check again here because they are pasted into SQL text.
_IDENTIFIER = re.compile(r"^[a-z][a-z0-9_]*$")


def connect(threads: int | None = None, memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    if memory_limit:
        con.execute(f"SET memory_limit = {literal(memory_limit)}")
    return con


def literal(value: str | Path) -> str:
    """A SQL string literal (for file paths in COPY, which cannot take prepared parameters)."""
    return "'" + str(value).replace("'", "''") + "'"


def identifier(name: str) -> str:
    if not _IDENTIFIER.match(name):
        raise ValueError(f"{name!r} is not a valid column name (lower case, digits, underscores)")
    return '"' + name + '"'


def sql(name: str, **fragments: str) -> str:
    """The text of ``src/vidlabel/sql/<name>.sql`` with ``@fragment@`` placeholders filled in.

    Placeholders only ever receive generated identifier lists (checked by ``identifier``), never data.
    """
    text = (SQL_DIR / f"{name}.sql").read_text()
    for key, value in fragments.items():
        marker = f"@{key}@"
        if marker not in text:
            raise KeyError(f"{name}.sql has no placeholder {marker}")
        text = text.replace(marker, value)
    if re.search(r"@[a-z_]+@", text):
        raise KeyError(f"{name}.sql: placeholder left unfilled: {re.search(r'@[a-z_]+@', text).group()}")
    return text


def parquet_view(con: duckdb.DuckDBPyConnection, name: str, paths: str | Path | Iterable[str | Path],
                 union_by_name: bool = False, file_row_number: bool = False) -> None:
    """Expose one or more Parquet files as view ``name``."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [str(p) for p in paths]
    rel = con.read_parquet(paths, union_by_name=union_by_name, file_row_number=file_row_number)
    rel.create_view(name, replace=True)


def copy_to_parquet(con: duckdb.DuckDBPyConnection, query: str, path: str | Path) -> None:
    """Write the result of ``query`` to ``path`` atomically (temp file + rename)."""
    with atomic_path(path) as tmp:
        con.execute(f"COPY ({query}) TO {literal(tmp)} (FORMAT parquet, COMPRESSION zstd)")


def copy_to_csv(con: duckdb.DuckDBPyConnection, query: str, path: str | Path) -> None:
    """Write the result of ``query`` to ``path`` as CSV with a header, atomically."""
    with atomic_path(path) as tmp:
        con.execute(f"COPY ({query}) TO {literal(tmp)} (FORMAT csv, HEADER true)")
