"""Benchmarks (``qerl bench kernels | rollout | step``), their peers (gemlite), targets and plots, and the rollout
engine's GPU check: the lab wing above the product. They call the product's own functions (the trainer's step, the
engine, the kernels) and build random-weight stand-ins at real shapes with :mod:`qerl.models.random`."""
