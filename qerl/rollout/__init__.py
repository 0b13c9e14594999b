"""Rollouts: the reference sampler (batched, KV cache, per-token log-probs) behind one seam."""
