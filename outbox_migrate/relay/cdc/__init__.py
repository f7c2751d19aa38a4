"""The second delivery style: stream committed outbox inserts from the WAL (CDC).

`relay --mode cdc` reads the unpublished partition's inserts from a logical replication slot
it creates and owns, publishes them through the ordinary sinks, marks the acknowledged rows
and only then confirms the slot position. `relay` (`CdcRelay`) wires the parts together;
docs/relay.md, "CDC mode", has the design and its measurements.
"""
