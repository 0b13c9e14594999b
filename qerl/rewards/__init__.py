"""Rewards: answer extraction, math-verify equivalence under a time limit, a registry."""
