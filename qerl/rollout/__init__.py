"""qerl.rollout."""
