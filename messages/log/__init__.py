"""The event log's records: every typed event a node writes (docs/logging.md)."""
