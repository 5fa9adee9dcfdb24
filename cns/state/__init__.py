"""What the node keeps on disk: the SQLite store, its write-ahead-log check, the state directory's
guards, crash-safe file writes and the reader of the plugins' release queue."""
