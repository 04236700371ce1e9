"""The CDC demo table: ``public.accounts`` in database ``cdc_demo`` of the local CDC source's
Postgres, captured by Debezium into topic ``cdc_demo.public.accounts``
(``backfill-assets stack up --cdc``; stack/cdc.py).

Its columns are the kinds teams have: a primary key, ``numeric(12,2)``, ``timestamptz``,
``jsonb`` and ``json``, and a ``text`` that can hold large values (Postgres keeps a value over
about 2 kB out of line, TOAST, which logical decoding does not repeat when an update leaves it
unchanged).
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

from backfill_assets.stack.cdc import CdcSource
from backfill_assets.stack.postgres import PgServer

DATABASE = "cdc_demo"
ROLE = "cdc"
TABLE = "public.accounts"
CONNECTOR = "cdc-demo"
TOPIC_PREFIX = "cdc_demo"
TOPIC = f"{TOPIC_PREFIX}.{TABLE}"

DDL = """
CREATE TABLE IF NOT EXISTS accounts (
    id bigint PRIMARY KEY,
    balance numeric(12, 2) NOT NULL,
    updated_at timestamptz NOT NULL,
    attrs jsonb,
    profile json,
    notes text
)
"""
INSERT = "INSERT INTO accounts VALUES (%s, %s, %s, %s, %s, %s)"


def row(account_id: int, rng: random.Random, notes_bytes: int = 64) -> tuple[Any, ...]:
    """One account: a balance with cents (negative ones too), a microsecond timestamp, a
    jsonb and a json document, and ``notes_bytes`` characters of random hex text (random so
    that Postgres cannot compress a large one back under its out-of-line threshold)."""
    balance = f"{rng.randint(-10_000_000, 10_000_000) / 100:.2f}"
    at = datetime(2024, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.randrange(10**13))
    attrs = {"tier": rng.choice(["free", "pro"]), "tags": ["a", "b"][: rng.randint(0, 2)]}
    profile = {"name": f"account {account_id}", "score": rng.random()}
    notes = rng.randbytes(notes_bytes // 2 + 1).hex()[:notes_bytes]
    return account_id, balance, at, json.dumps(attrs), json.dumps(profile), notes


def start(source: CdcSource, rows: int = 5) -> tuple[PgServer, str]:
    """Start the CDC source, create the demo table (``rows`` accounts when it is empty) and
    register its connector (JSON with schemas); the topic it writes."""
    server, _ = source.start()
    db = source.database(server, DATABASE, ROLE)
    con = server.connect(DATABASE, db.user, db.password)
    try:
        with con.cursor() as cur:
            cur.execute(DDL)
            cur.execute("SELECT count(*) FROM accounts")
            if cur.fetchone()[0] == 0:
                rng = random.Random(48)
                for account_id in range(1, rows + 1):
                    cur.execute(INSERT, row(account_id, rng))
    finally:
        con.close()
    source.connector(
        CONNECTOR, db, topic_prefix=TOPIC_PREFIX, tables=[TABLE], slot="cdc_demo", schemas=True
    )
    return server, TOPIC
