"""RL math: group advantages, policy losses (the presets of :mod:`qerl.rl.algorithms`: GRPO / DAPO / Dr. GRPO /
GSPO), AQN schedule and injection, dynamic sampling and overlong handling. Pure tensor functions except
:mod:`qerl.rl.aqn`'s module patching."""
