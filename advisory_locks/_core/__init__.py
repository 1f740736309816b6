"""The lock machinery every binding shares: the lock contract, the advisory lock, the
per-connection state and the driver executors."""
