"""Synchronisation between virtual workers (HetPipe §5): the staleness rules and the
parameter servers that hold the global weights."""
