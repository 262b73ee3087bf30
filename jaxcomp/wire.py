"""Versioned byte format of a payload (docs/wire-format.md)."""
