"""The SQL a migration installs, frozen in ``sql/{revision}_{name}.sql`` beside this module.

A migration reads its own revision's copies (and, to downgrade, those of the
revision before), never the live files in ``jobplane/store/sql/``: those
change with the next migration, and a migration must install what it always
installed (docs/adr/0035-sql-api-as-files.md).
"""

from __future__ import annotations

from pathlib import Path

_DIRECTORY = Path(__file__).with_name("sql")


def frozen_sql(name: str, schema: str | None = None) -> str:
    """The frozen copy ``name``, with ``@SCHEMA@`` replaced by ``schema`` when given.

    ``@SCHEMA@`` is where jobplane's tables are, fixed in a SECURITY DEFINER
    function's ``search_path`` when it is created, so that no caller's
    ``search_path`` can point it at tables of its own.
    """
    sql = (_DIRECTORY / name).read_text(encoding="utf-8")
    return sql if schema is None else sql.replace("@SCHEMA@", schema)
