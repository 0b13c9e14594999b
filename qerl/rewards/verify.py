"""Answer equivalence through ``math-verify`` under a hard time limit.

math-verify's own timeouts use ``signal.alarm`` (main thread only) and sympy can still stall on
adversarial input (huge powers, deep nesting). Every check here runs in a persistent worker
process; if it does not answer within ``timeout`` seconds the worker is killed and restarted and the
answer scores 0. Inputs longer than ``max_chars`` score 0 without being parsed. So a pathological
completion costs at most the limit and never hangs or crashes the trainer.
"""
from __future__ import annotations

import multiprocessing as mp
import threading


def _as_math(text: str) -> str:
    """Extracted answers are bare LaTeX (``\\frac12``, ``x^2``): math-verify needs math mode."""
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def _worker(conn, inner_timeout: int) -> None:
    from math_verify import parse, verify

    conn.send("ready")  # imports (sympy: ~1 s) are not charged to the first answer's time limit
    while True:
        msg = conn.recv()
        if msg is None:
            return
        gold, answer = msg
        try:
            # math-verify's own (signal-based) limits first; the parent's kill is the backstop
            g = parse(_as_math(gold), parsing_timeout=inner_timeout)
            a = parse(_as_math(answer), parsing_timeout=inner_timeout)
            ok = bool(g) and bool(a) and bool(verify(g, a, timeout_seconds=inner_timeout))
        except Exception:  # malformed latex etc.: not equivalent
            ok = False
        conn.send(ok)


class MathVerifier:
    """``verifier(gold, answer) -> bool`` (equivalent under math-verify), bounded in time."""

    def __init__(self, timeout: float = 5.0, max_chars: int = 1000):
        if timeout <= 0:
            raise ValueError(f"math-verify timeout must be > 0 s, got {timeout}")
        self.timeout = timeout
        self.max_chars = max_chars
        self._proc = None
        self._conn = None
        self._lock = threading.Lock()
        self.checks = 0  # answers sent to the worker (the others were decided without parsing)
        self.timeouts = 0  # of those, the ones the worker did not answer within ``timeout`` (killed, scored 0)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # no forked torch state in the worker
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, max(1, int(self.timeout))), daemon=True)
        self._proc.start()
        if not parent.poll(120) or parent.recv() != "ready":
            self._proc.kill()
            raise RuntimeError("math-verify worker process did not start")
        self._conn = parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc = self._conn = None

    def __call__(self, gold: str, answer: str | None) -> bool:
        if not answer or not gold:
            return False
        if len(answer) > self.max_chars or len(gold) > self.max_chars:
            return False
        if answer.strip() == gold.strip():
            return True
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((gold, answer))
            self.checks += 1
            if self._conn.poll(self.timeout):
                return bool(self._conn.recv())
            self.timeouts += 1
            self._kill()
            return False

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            self._kill()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
