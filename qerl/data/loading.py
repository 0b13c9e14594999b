"""Build the training records a config asks for."""
from __future__ import annotations

from qerl.data.tasks import DataError, HUB_TASKS, load_hub, load_local, synthetic_arithmetic


def load_train_records(data_cfg, seed: int) -> list[dict]:
    """Records ``{"prompt", "answer"}`` for ``data_cfg.task`` ('synthetic', 'local' or a hub task)."""
    if data_cfg.task == "synthetic":
        return synthetic_arithmetic(data_cfg.synthetic_size, seed=seed, max_operand=data_cfg.synthetic_max_operand)
    if data_cfg.task == "local":
        if not data_cfg.path:
            raise DataError("data.path: required when data.task is 'local'")
        records = load_local(data_cfg.path, data_cfg.prompt_field, data_cfg.answer_field, data_cfg.answer_format)
        if not records:
            raise DataError(f"data.path {data_cfg.path}: holds no problems (an empty file)")
        return records
    if data_cfg.task in HUB_TASKS:
        return load_hub(data_cfg.task, data_cfg.revision)
    raise DataError(f"data.task: {data_cfg.task!r} is not 'synthetic', 'local' or one of {sorted(HUB_TASKS)}")
