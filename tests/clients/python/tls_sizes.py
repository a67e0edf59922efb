#!/usr/bin/env python3
"""Results of many sizes through libpq's asynchronous API (psycopg's AsyncConnection) over
TLS, each bounded by a timeout: libpq's async reads can wait forever for bytes that a large
TLS record left inside OpenSSL, so a pooler must keep its records small. Prints one line and
exits non-zero on a wrong result or a stall.

Usage: tls_sizes.py DSN
"""

import asyncio
import sys

import psycopg


async def main(dsn):
    checked = 0
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        # One big value, and many rows, across the sizes around libpq's buffer doublings.
        for n in list(range(7_900, 8_400, 13)) + list(range(16_200, 16_600, 11)) + list(range(81_700, 82_100, 7)):
            cur = await asyncio.wait_for(conn.execute("SELECT repeat('x', %s)", (n,)), 10)
            row = await cur.fetchone()
            if len(row[0]) != n:
                raise AssertionError(f"value of {n} bytes came back as {len(row[0])}")
            checked += 1
        for k in range(700, 900, 3):
            cur = await asyncio.wait_for(
                conn.execute("SELECT repeat('y', 90) FROM generate_series(1, %s)", (k,)), 10)
            rows = await cur.fetchall()
            if len(rows) != k:
                raise AssertionError(f"{k} rows came back as {len(rows)}")
            checked += 1
    print(f"psycopg async over TLS: {checked} result sizes")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
