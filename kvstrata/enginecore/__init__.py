"""kvstrata.enginecore."""
