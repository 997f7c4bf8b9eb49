"""The pipeline's stages in order: what each reads, which config sections it depends on, and
the ``rlhf_core`` function that runs it. The command line (``rlhf run``) and the Prefect
tasks (``tasks/stages.py``) both run stages from this one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .config import PipelineConfig
from .tracking import Tracker


@dataclass(frozen=True)
class Stage:
    """One stage.

    ``inputs`` names the stages whose output directories it reads, in the order ``run``
    takes them; ``sections`` are the config sections it depends on itself (upstream
    sections reach it through its inputs). ``run(cfg, input_dirs, out_dir, tracker)``
    writes the stage's output into ``out_dir`` and returns its metrics or record.
    """

    name: str
    inputs: tuple[str, ...]
    sections: tuple[str, ...]
    run: Callable[[PipelineConfig, list[Path], Path, Tracker], dict[str, Any]]


def _data(cfg, inputs, out, tracker):
    from .data import prepare_data

    return prepare_data(cfg, out, overwrite=True)


def _base_model(cfg, inputs, out, tracker):
    from .models import import_base_model

    return import_base_model(cfg.model, out, overwrite=True)


def _sft(cfg, inputs, out, tracker):
    from .sft import run_sft

    data, base = inputs
    return run_sft(cfg.sft, data, base, out, tracker)


def _reward(cfg, inputs, out, tracker):
    from .reward import run_reward_training

    data, sft = inputs
    return run_reward_training(cfg.reward, data, sft / "model", out, tracker)


def _reward_norm(cfg, inputs, out, tracker):
    from .reward import normalize_reward_model

    data, reward = inputs
    return normalize_reward_model(cfg.reward, data, reward / "model", out, tracker)


def _reward_eval(cfg, inputs, out, tracker):
    from .reward import evaluate_reward_model

    data, reward_norm = inputs
    return evaluate_reward_model(cfg.reward, data, reward_norm / "model", out, tracker)


def _ppo(cfg, inputs, out, tracker):
    from .ppo_trainer import run_ppo

    data, sft, reward_norm = inputs
    return run_ppo(cfg.ppo, data, sft / "model", reward_norm / "model", out, tracker)


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("data", (), ("data", "model"), _data),
        Stage("base_model", (), ("model",), _base_model),
        Stage("sft", ("data", "base_model"), ("sft",), _sft),
        Stage("reward", ("data", "sft"), ("reward",), _reward),
        Stage("reward_norm", ("data", "reward"), ("reward",), _reward_norm),
        Stage("reward_eval", ("data", "reward_norm"), ("reward",), _reward_eval),
        Stage("ppo", ("data", "sft", "reward_norm"), ("ppo",), _ppo),
    )
}


def upstream_sections(name: str) -> tuple[str, ...]:
    """The config sections ``name`` depends on, its own and those of every stage before it, sorted."""
    stage = STAGES[name]
    found = set(stage.sections)
    for dep in stage.inputs:
        found |= set(upstream_sections(dep))
    return tuple(sorted(found))
