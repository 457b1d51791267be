"""kvstrata.kv."""
