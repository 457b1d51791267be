"""kvstrata.io."""
