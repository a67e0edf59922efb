#!/usr/bin/env python3
"""Runs, through psycopg 3, the queries the community PgBouncer Prometheus exporter runs
against the admin console, and prints what each returned as JSON: {query: {"columns": [...],
"rows": n}}. Exits non-zero on any error.

Usage: exporter_queries.py DSN   (the DSN names the console database, e.g. dbname=pgbouncer)
"""

import json
import sys

import psycopg

QUERIES = ["SHOW STATS", "SHOW POOLS", "SHOW DATABASES", "SHOW CONFIG", "SHOW LISTS", "SHOW VERSION"]

out = {}
# The console has no transactions: autocommit, as the exporter's driver does.
with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    for q in QUERIES:
        with conn.cursor() as cur:
            cur.execute(q)
            rows = cur.fetchall()
            out[q] = {"columns": [d.name for d in cur.description], "rows": len(rows),
                      "first": [str(v) for v in rows[0]] if rows else []}
json.dump(out, sys.stdout)
