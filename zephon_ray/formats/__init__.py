"""Durable formats, one owner module each: read, write and check (see docs/concepts.md)."""
