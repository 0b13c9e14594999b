"""qerl.rewards."""
