"""The second delivery style: stream committed outbox inserts from the WAL (CDC).

`relay --mode cdc` reads the unpublished partition's inserts from a logical replication slot
(`pgoutput`) it creates and owns, publishes them per transaction batch through the ordinary
sinks, marks the acknowledged rows (one set-based UPDATE per batch, so the partitioned layout
stays small) and only then confirms the slot position. Pieces:

* `pgoutput` — a small decoder of the pgoutput messages the relay needs (pure, no I/O);
* `stream` — the replication protocol over psycopg 3's libpq layer (no extra dependency);
* `slot` — publication, slot, lag and decommissioning statements over a normal session;
* `session` — one replication connection's stream loop (given its collaborators);
* `marks` — the second session: marks sent behind the stream, one at a time;
* `mark_repair` — a mark that breaks a constraint: the rest marked, the failing rows counted;
* `delivery` — the sink's retries; attempts and dead letters go through the polling relay's
  policy (relay/bad_rows.py), one for both styles;
* `backlog` — the first start's rows, picked by the slot's snapshot, published in batches;
* `columns`, `rows` — rows as messages (from the stream, or read back); the counters, metrics
  and options are the polling relay's modules (run_stats, metrics, options), extended;
* `relay` — wires them together (`CdcRelay`): preparation, slot ownership, reconnects.

See docs/relay.md, "CDC mode", for the design and the measurements behind it.
"""
