"""RL math: group advantages, policy losses (GRPO / DAPO / Dr. GRPO), AQN schedule and injection,
dynamic sampling and overlong handling. Pure tensor functions except :mod:`qerl.rl.aqn`'s
module patching."""
