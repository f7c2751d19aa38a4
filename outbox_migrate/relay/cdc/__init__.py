"""The second delivery style: stream committed outbox inserts from the WAL (`relay --mode cdc`,
docs/relay.md, "CDC mode"). A slot position is confirmed only after its rows were marked."""
