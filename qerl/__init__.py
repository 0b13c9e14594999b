"""qerl."""
