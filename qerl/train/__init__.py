"""qerl.train."""
