"""qerl.data."""
