"""TRL's ``GRPOTrainer`` rolling out on qerl's engine, and AQN as a ``TrainerCallback``.

    trainer = GRPOTrainer(model=peft_model, reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                          rollout_func=qerl.hf.rollout_func(), callbacks=[qerl.hf.AQNCallback()])

:func:`rollout_func` returns TRL's ``rollout_func(prompts, trainer)``: the prompts (each already repeated
``num_generations`` times by TRL's sampler) are sampled by :func:`qerl.rollout.generate` on the trainer's own
model — the rollout engine on CUDA, the reference sampler elsewhere — so there is no second copy of the weights
and nothing to synchronise: the engine reads the live LoRA adapters. It returns, per prompt row, the prompt's
token ids, the completion's ids (EOS included) and the sampling policy's log-probs ``log softmax(logits / T)`` of
each drawn token, the quantity TRL recomputes as its ``old_per_token_logps``.
"""
from __future__ import annotations

import contextlib

from transformers import TrainerCallback

from qerl.rl.aqn import AQN, AQNSettings, sigma_at


def _prompt_texts(tokenizer, prompts: list) -> list[str]:
    """TRL's prompts as text: a conversation goes through the chat template (generation prompt added), a string
    stays as it is (TRL tokenizes both without special tokens)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and all(isinstance(m, dict) and "role" in m for m in p):
            out.append(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True))
        else:
            raise TypeError(f"qerl rollout_func: a prompt is a string or a list of chat messages; got {type(p).__name__}")
    return out


class _Rollout:
    """The callable :func:`rollout_func` returns (``(prompts, trainer) -> dict``)."""

    def __init__(self, engine: str, seed: int, max_new_tokens: int | None, release_cache: bool):
        self.engine, self.seed, self.max_new_tokens, self.release_cache = engine, seed, max_new_tokens, release_cache
        self.calls = 0
        self.capped: set = set()  # (prompt length, asked length) pairs already said

    def settings(self, args, max_new_tokens: int | None = None):
        from qerl.rollout import SamplingSettings

        return SamplingSettings(temperature=float(args.temperature), top_p=float(args.top_p or 1.0),
                                top_k=int(args.top_k or 0),
                                max_new_tokens=int(max_new_tokens or self.max_new_tokens or args.max_completion_length),
                                engine=self.engine, release_cache=self.release_cache)

    def fit_context(self, model, tokenizer, texts: list[str], want: int) -> int:
        """The completion length this call samples: ``want``, capped so that the longest prompt plus its completion
        fits the model's context (``config.max_position_embeddings``), saying so once; a prompt that leaves no room
        is a ``ValueError`` naming the lengths (``qerl train`` refuses such prompts the same way)."""
        ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if not ctx:
            return want
        longest = max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
        if longest + want <= ctx:
            return want
        room = ctx - longest
        if room < 1:
            raise ValueError(f"qerl rollout_func: a prompt of {longest} tokens fills the model's context "
                             f"(max_position_embeddings {ctx}): no room for a completion; shorten the prompts")
        if (longest, want) not in self.capped:
            self.capped.add((longest, want))
            import warnings

            warnings.warn(f"qerl rollout_func: prompt ({longest} tokens) + max_completion_length {want} > the model's "
                          f"context ({ctx}, max_position_embeddings): completions capped at {room} tokens",
                          stacklevel=3)
        return room

    def __call__(self, prompts: list, trainer) -> dict:
        import torch

        from qerl.rollout import generate

        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        texts = _prompt_texts(tokenizer, prompts)
        want = int(self.max_new_tokens or trainer.args.max_completion_length)
        settings = self.settings(trainer.args, self.fit_context(model, tokenizer, texts, want))
        rank, n = trainer.accelerator.process_index, len(texts)
        seed = self.seed + self.calls  # a fresh draw each call; rows of other processes draw their own rows
        self.calls += 1
        noise = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AQNCallback)), None)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), (noise.rollout(seed) if noise is not None else contextlib.nullcontext()):
                ro = generate(model, tokenizer, texts, settings, seed=seed, num_samples=1, first_row=rank * n)
        finally:
            model.train(was_training)
            if settings.release_cache is True and next(model.parameters()).device.type == "cuda":
                from qerl.rollout.engine import release_engine

                release_engine(model)  # the KV cache and graphs go: TRL's update gets that memory
        if noise is not None and isinstance(getattr(trainer, "_metrics", None), dict):  # TRL logs it with its own
            trainer._metrics["train" if was_training else "eval"]["aqn/sigma"].append(noise.sigma)
        prompt_ids, completion_ids, logprobs = [], [], []
        for i in range(n):
            keep = ro.completion_mask[i].bool()
            prompt_ids.append(ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist())
            completion_ids.append(ro.completion_ids[i][keep].tolist())
            logprobs.append(ro.logprobs[i][keep].float().tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def rollout_func(engine: str = "auto", seed: int = 0, max_new_tokens: int | None = None, release_cache: bool = True):
    """TRL ``GRPOTrainer``'s ``rollout_func`` on qerl's rollout engine (see the module docstring).

    Sampling follows the trainer's ``GRPOConfig``: ``temperature``, ``top_p``, ``top_k`` and
    ``max_completion_length`` (``max_new_tokens`` overrides the last). ``engine``: ``auto`` (the engine on CUDA
    for models it runs, the reference sampler otherwise), ``engine`` or ``reference`` (:mod:`qerl.rollout`).
    ``seed``: the first call's; each later call draws with the next seed, and a row's draw depends only on its
    seed and its global row index (:func:`qerl.rollout.sampling.row_seeds`), so a run reproduces.
    ``release_cache``: free the engine's KV cache and CUDA graphs after each rollout (as ``qerl train`` does by
    default), so the update has that memory; ``False`` keeps them for the next rollout (no re-capture)."""
    from qerl.rollout.sampling import ENGINES

    if engine not in ENGINES:
        raise ValueError(f"rollout_func: engine {engine!r}, expected one of {list(ENGINES)}")
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
                                       or max_new_tokens < 1):
        raise ValueError(f"rollout_func: max_new_tokens must be a positive int or None, got {max_new_tokens!r}")
    if not isinstance(release_cache, bool):
        raise ValueError(f"rollout_func: release_cache must be True or False, got {release_cache!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"rollout_func: seed must be an int, got {seed!r}")
    return _Rollout(engine, seed, max_new_tokens, release_cache)


class AQNCallback(TrainerCallback):
    """Adaptive Quantization Noise (paper §3, Alg. 1) for a ``transformers`` / TRL trainer.

    Each step's σ follows the staged schedule of :func:`qerl.rl.aqn.sigma_at` over ``state.max_steps`` (stage 0
    noise-free, then K stages from ``sigma_start`` to ``sigma_end``); a fresh ``Z ~ N(0, σ²)`` is added to the
    RMSNorm weights that feed the quantized q/k/v and gate/up projections (:class:`qerl.rl.aqn.AQN`).
    ``apply_to="rollout"`` (the paper): the noise is active only while :func:`rollout_func` samples, so the
    trainer needs ``rollout_func=qerl.hf.rollout_func()`` (a step with σ > 0 and no qerl rollout is an error, not
    a silent no-op). ``"rollout+train"``: the draw stays on for the whole step, whoever generates. Each qerl
    rollout logs its σ as ``aqn/sigma`` among TRL's metrics."""

    def __init__(self, sigma_start: float = 1e-2, sigma_end: float = 5e-4, stages: int = 10,
                 schedule: str = "exponential", apply_to: str = "rollout", final_norm: bool = False, seed: int = 0):
        import math

        for name, v in (("sigma_start", sigma_start), ("sigma_end", sigma_end)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"AQNCallback: {name} {v!r}: a finite number > 0 (the paper: 1e-2 to 5e-4)")
        for name, v, lo in (("stages", stages, 1), ("seed", seed, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"AQNCallback: {name} {v!r}: a whole number >= {lo}")
        if not isinstance(final_norm, bool):
            raise ValueError(f"AQNCallback: final_norm {final_norm!r}: True or False")
        self.settings = AQNSettings(enabled=True, sigma_start=sigma_start, sigma_end=sigma_end, stages=stages,
                                    schedule=schedule, apply_to=apply_to, final_norm=final_norm)
        self.seed = seed
        self.aqn: AQN | None = None
        self.sigma = 0.0
        self.rollouts = 0  # qerl rollouts since training began
        self.history: list[tuple[int, float]] = []  # (step, σ) of every step

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("AQNCallback: the trainer passed no model to on_train_begin")
        self.aqn = AQN(model, self.settings)

    def on_step_begin(self, args, state, control, **kwargs):
        self.sigma = sigma_at(min(state.global_step, state.max_steps - 1), state.max_steps, self.settings)
        self.history.append((state.global_step, self.sigma))
        if self.settings.apply_to == "rollout+train":
            self.aqn.draw(self.sigma, self.seed + state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.settings.apply_to == "rollout+train":
            self.aqn.clear()
        elif self.sigma > 0 and self.rollouts == 0:
            raise RuntimeError("AQNCallback(apply_to='rollout') adds noise to rollouts made by qerl's rollout_func, "
                               "and this trainer made none: pass rollout_func=qerl.hf.rollout_func() to the "
                               "trainer, or AQNCallback(apply_to='rollout+train')")

    def rollout(self, seed: int):
        """The context a qerl rollout samples in: this step's draw active (σ = 0: none)."""
        self.rollouts += 1
        if self.aqn is None or self.settings.apply_to != "rollout":
            return contextlib.nullcontext()
        return self.aqn.noise(self.sigma, self.seed + 7919 * seed + 1)
