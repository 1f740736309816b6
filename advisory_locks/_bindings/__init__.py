"""Bindings: each turns one kind of bind (a SQLAlchemy Session, a psycopg connection, ...)
into the connection a lock runs on, and registers itself with the core dispatch."""
