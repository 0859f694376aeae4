"""An older database brought up to this version: `migrate` adds the columns and indexes this version added to
the tables an older version created (create_all only creates missing tables: a new table, such as run_samples,
needs nothing here). `Store.__init__` runs it after create_all.
"""

from __future__ import annotations

from sqlalchemy import inspect, text

from whitney.service.store.tables import KeyRow, OperationRow, PackageRow, SessionRow


def migrate(engine) -> None:
    """ALTER TABLE ... ADD COLUMN for each column of the packages, sessions, operations and api_keys tables the database
    lacks, and CREATE INDEX for each named index of the operations table it lacks. (A new table, such as
    run_samples, is made by create_all.)"""
    found = inspect(engine)
    table = OperationRow.__table__
    if found.has_table(table.name):
        have = {i["name"] for i in found.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in have:
                index.create(engine)
    for table in (PackageRow.__table__, SessionRow.__table__, OperationRow.__table__, KeyRow.__table__):
        if not found.has_table(table.name):
            continue
        have = {c["name"] for c in found.get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            ddl = f"ALTER TABLE {table.name} ADD COLUMN {column.name} {column.type.compile(engine.dialect)}"
            if column.server_default is not None:
                default = column.server_default.arg
                ddl += f" DEFAULT {default if isinstance(default, str) else default.compile(dialect=engine.dialect)}"
            with engine.begin() as conn:
                conn.execute(text(ddl))
                if column.index:
                    conn.execute(text(f"CREATE INDEX ix_{table.name}_{column.name} ON {table.name} ({column.name})"))
