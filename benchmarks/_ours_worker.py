"""Our side of ``benchmarks/vs_trl.py``: input preparation and one timed training run, in ``.venv``.

Run by the benchmark as ``.venv/bin/python benchmarks/_ours_worker.py prep|run SPEC.json``.

``prep`` runs the pipeline's ``data`` and ``base_model`` stages into the work directory (reused
when their configuration is unchanged, as ``rlhf stages`` does), builds an untrained reward model
(:class:`rlhf_core.train.reward.ScalarModel`) for our PPO, and writes the exact rows each stage will
train on, in our batch order, as plain token-id lists (``rows-<stage>.json``) for both sides. It
prints ``BENCH_RESULT {...}`` with the resolved settings (learning rates, lengths, paths) so the
TRL side gets the same numbers.

``run`` times one stage through our public entry points: ``run_sft``, ``run_reward_training``
and ``run_dpo`` (from the base model, as the reward stage; a tracker records the time at the end
of every optimiser step and stops the stage after the last one, so the post-training save and
evaluation are neither run nor timed), and ``run_ppo`` likewise, its evaluation and checkpoints
set beyond the timed updates. It prints ``BENCH_RESULT {...}``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path


def _config(spec: dict):
    from rlhf_core.config.presets import load_config

    return load_config(spec["preset"], spec.get("overrides", []))


# ------------------------------------------------------------------------------ prep


def dpo_rows(chosen: list[list[int]], rejected: list[list[int]], query_lengths: list[int], max_length: int) -> dict:
    """Split unpadded query+response rows into the shared prompt and the two responses (TRL's
    ``prompt_ids``, ``chosen_ids``, ``rejected_ids``: responses without the query, EOS kept)."""
    prompts, chosen_resp, rejected_resp = [], [], []
    for c, r, q in zip(chosen, rejected, query_lengths):
        if c[:q] != r[:q] or q >= len(c) or q >= len(r) or max(len(c), len(r)) > max_length:
            raise SystemExit(
                f"dpo: a pair does not share its {q}-token query, lacks a response or exceeds {max_length}"
            )
        prompts.append(c[:q])
        chosen_resp.append(c[q:])
        rejected_resp.append(r[q:])
    return {"prompt_ids": prompts, "chosen_ids": chosen_resp, "rejected_ids": rejected_resp, "max_length": max_length}


def prep(spec: dict) -> dict:
    """Data, base model, our reward model, and the rows of every requested stage."""
    from rlhf_core.data.prepared import load_prepared
    from rlhf_core.models.saved import save_pretrained_atomic
    from rlhf_core.ppo.rollout import prompt_indices
    from rlhf_core.run.cli import run_stages
    from rlhf_core.train.reward import ScalarModel, reward_model_from_causal_lm
    from rlhf_core.train.training import batch_order

    work = Path(spec["work"])
    cfg = _config(spec)
    run_stages(cfg, work, "base_model")
    data_dir, base_dir = work / "data", work / "base_model"
    sft, pref, stats = load_prepared(data_dir)
    pad = stats["tokenizer"]["pad_token_id"]
    out: dict = {
        "data_dir": str(data_dir),
        "base_model_dir": str(base_dir),
        "tokenizer_dir": str(data_dir / "tokenizer"),
        "padded_lengths": stats["padded_lengths"],
        "pad_token_id": pad,
        "eos_token_id": stats["tokenizer"]["eos_token_id"],
        "n_params": json.loads((base_dir / "import.json").read_text())["parameters"],
        "stages": {},
    }

    def unpad(row: list[int]) -> list[int]:
        return [t for t in row if t != pad]

    for stage, s in spec["stages"].items():
        steps, batch = s["steps"], s["batch_size"]
        info: dict = {"rows": str(work / f"rows-{stage}.json")}
        if stage in ("sft", "reward", "dpo"):
            section = {"sft": cfg.sft, "reward": cfg.reward, "dpo": cfg.dpo}[stage]
            split = sft["train"] if stage == "sft" else pref["train"]
            per_epoch = max(1, len(split) // batch)
            epochs = math.ceil(steps / per_epoch)
            order = batch_order(len(split), batch, epochs, section.seed)[:steps]
            if len(order) < steps or any(len(b) != batch for b in order):
                raise SystemExit(f"{stage}: {len(split)} rows cannot make {steps} batches of {batch}")
            flat = [i for b in order for i in b]
            if stage == "sft":
                ids = [unpad(r) for r in split.select(flat)["query_reference_response_token"]]
                rows = {"input_ids": ids, "max_length": stats["padded_lengths"]["sft_query_response"]}
                lengths = [len(r) for r in ids]
            else:
                sel = split.select(flat)
                chosen = [unpad(r) for r in sel["query_chosen_token"]]
                rejected = [unpad(r) for r in sel["query_rejected_token"]]
                max_length = stats["padded_lengths"]["rm_query_response"]["tldr"]
                if stage == "reward":
                    rows = {"chosen_ids": chosen, "rejected_ids": rejected, "max_length": max_length}
                else:
                    rows = dpo_rows(chosen, rejected, list(sel["query_token_len"]), max_length)
                    info["dpo"] = {"beta": cfg.dpo.beta}
                    info["responses_ending_with_eos"] = sum(
                        r[-1] == out["eos_token_id"] for r in rows["chosen_ids"] + rows["rejected_ids"]
                    ) / (2 * len(chosen))
                lengths = [len(c) + len(r) for c, r in zip(chosen, rejected)]
            rows["tokens_per_step"] = [sum(lengths[k * batch : (k + 1) * batch]) for k in range(steps)]
            # what each side pads to: ours the dataset-wide padded length, TRL the longest row of a micro-batch
            info.update(
                num_epochs=epochs,
                learning_rate=section.learning_rate,
                adam_eps=section.adam_eps,
                scheduler=section.scheduler,
                seed=section.seed,
                tokens_per_step=rows["tokens_per_step"],
                max_length=rows["max_length"],
            )
        else:
            p = cfg.ppo
            queries = list(sft["train"]["query_token"])
            order = [i for u in range(steps) for i in prompt_indices(len(queries), batch, u, p.seed)]
            rows = {"queries": [unpad(queries[i]) for i in order]}
            reward_dir = work / "reward_model_untrained"
            if not (reward_dir / "config.json").is_file():
                rm = reward_model_from_causal_lm(base_dir, seed=cfg.reward.seed)
                save_pretrained_atomic(rm, reward_dir)
            ScalarModel.from_pretrained(str(reward_dir))  # loads as our PPO will load it
            info.update(
                learning_rate=p.learning_rate,
                adam_eps=p.adam_eps,
                scheduler=p.scheduler,
                seed=p.seed,
                reward_model_dir=str(reward_dir),
                response_length=p.response_length or stats["padded_lengths"]["sft_response"],
                ppo={
                    k: getattr(p, k)
                    for k in (
                        "ppo_epochs",
                        "num_minibatches",
                        "temperature",
                        "kl_coef",
                        "cliprange",
                        "cliprange_value",
                        "vf_coef",
                        "gamma",
                        "lam",
                        "whiten_rewards",
                        "non_eos_penalty",
                    )
                },
            )
            info["ppo"]["response_length"] = info["response_length"]
        Path(info["rows"]).write_text(json.dumps(rows))
        out["stages"][stage] = info
    return out


# ------------------------------------------------------------------------------- run


class _Done(Exception):
    """Raised by the tracker after the last timed step: skips the stage's save and evaluation."""


def _now() -> float:
    """``time.perf_counter()`` once the GPU, where there is one, has run the work queued on it."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class _StepClock:
    """A tracker that records the clock (:func:`_now`) at the end of each optimiser step."""

    def __init__(self, steps: int):
        self.steps = steps
        self.ends: list[float] = []
        self.tokens_per_s: list[float] = []
        self.params_at: float | None = None

    def log_params(self, params):
        self.params_at = time.perf_counter()  # just before train_loop starts

    def log_metrics(self, metrics, step=None):
        if "tokens_per_s" not in metrics:
            return
        self.ends.append(_now())
        self.tokens_per_s.append(metrics["tokens_per_s"])
        if step is not None and step >= self.steps:
            raise _Done

    def log_table(self, name, rows):
        pass

    def log_artifact(self, path, artifact_path=None):
        pass


class _UpdateClock(_StepClock):
    """A tracker that records the end of each PPO update and the phase times ``run_ppo`` logs."""

    def __init__(self, steps: int):
        super().__init__(steps)
        self.phases: list[dict] = []

    def log_params(self, params):
        self.params_at = time.perf_counter()  # the four models are loaded

    def log_metrics(self, metrics, step=None):
        if "time/train" not in metrics:
            return
        self.ends.append(_now())
        self.phases.append(
            {
                "rollout_s": metrics["time/generate"] + metrics["time/score"],
                "train_s": metrics["time/train"],
                "generate_s": metrics["time/generate"],
                "score_s": metrics["time/score"],
            }
        )
        if step is not None and step >= self.steps:
            raise _Done


def _timed_window(ends: list[float], first_step_seconds: float, warmup: int = 1) -> dict:
    """The steps after the first ``warmup`` (untimed warm-up), at most all but the first; the
    first step alone, flagged, when there is only one."""
    skip = min(warmup, len(ends) - 1)
    if skip >= 1:
        return {"timed_seconds": ends[-1] - ends[skip - 1], "timed_from_step": skip, "warmup_included": False}
    return {"timed_seconds": first_step_seconds, "timed_from_step": 0, "warmup_included": True}


def levers_off() -> None:
    """The device's speed levers turned off for this process: the CPU's kernel choices
    (``DEFAULT_TUNING``: unfused AdamW, 32 MiB head chunks, exact widths, rows in data order)
    and eager decoding with a dynamic KV cache, whatever the device."""
    from rlhf_core.train import generation, training

    training.CUDA_TUNING = training.DEFAULT_TUNING
    generation.COMPILED_STATIC_CACHE = generation.DYNAMIC_CACHE


def run(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    if spec.get("levers", "on") == "off":
        levers_off()
    import logging

    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("rlhf_core.train.generation").setLevel(logging.INFO)  # which decoding ran, and any fallback
    import transformers

    transformers.utils.logging.set_verbosity_error()
    cfg = _config(spec)
    stage, steps = spec["stage"], spec["steps"]
    out_dir = Path(spec["out_dir"])
    section = {"sft": cfg.sft, "reward": cfg.reward, "dpo": cfg.dpo, "ppo": cfg.ppo}[stage]
    result: dict = {"side": "ours", "stage": stage, "gradient_checkpointing": section.gradient_checkpointing}
    from rlhf_core.train.generation import decoding_for
    from rlhf_core.train.training import device_tuning

    result["tuning"] = dataclasses.asdict(device_tuning(spec["device"]))
    result["decoding"] = repr(decoding_for(spec["device"]))
    t_load = time.perf_counter()
    if stage in ("sft", "reward", "dpo"):
        clock = _StepClock(steps)
        try:
            if stage == "sft":
                from rlhf_core.train.sft import run_sft

                run_sft(cfg.sft, spec["data_dir"], spec["base_model_dir"], out_dir, clock)
            elif stage == "reward":
                from rlhf_core.train.reward import run_reward_training

                run_reward_training(cfg.reward, spec["data_dir"], spec["base_model_dir"], out_dir, clock)
            else:
                from rlhf_core.train.dpo import run_dpo

                # the base model stands in for the SFT policy: policy and frozen reference start from it
                run_dpo(cfg.dpo, spec["data_dir"], spec["base_model_dir"], out_dir, clock)
        except _Done:
            pass
        if len(clock.ends) != steps:
            raise RuntimeError(f"expected {steps} steps, got {len(clock.ends)}")
        tokens = spec["tokens_per_step"]
        first = tokens[0] / clock.tokens_per_s[0]  # train_loop's own timing of step 1
        result.update(_timed_window(clock.ends, first, spec.get("warmup", 1)))
        result["step_seconds"] = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
        result["step_ends"] = clock.ends
        result["train_loop_tokens_per_s"] = clock.tokens_per_s
        result["load_seconds"] = (clock.params_at or t_load) - t_load
        model_params = None
    else:
        from rlhf_core.ppo.trainer import run_ppo

        # no evaluation or checkpoint inside the timed updates, and the run stopped after them
        p = cfg.ppo
        ppo_cfg = p.model_copy(
            update={
                "eval_every": steps + 1,
                "checkpoint_every": steps + 1,
                "total_episodes": max(p.total_episodes, (steps + 1) * p.batch_size),
            }
        )
        clock = _UpdateClock(steps)
        try:  # on the device main() left visible
            run_ppo(ppo_cfg, spec["data_dir"], spec["base_model_dir"], spec["reward_model_dir"], out_dir, clock)
        except _Done:
            pass
        if len(clock.ends) != steps:
            raise RuntimeError(f"expected {steps} updates, got {len(clock.ends)}")
        result["load_seconds"] = (clock.params_at or t_load) - t_load
        first = clock.ends[0] - (clock.params_at or t_load)
        result.update(_timed_window(clock.ends, first, spec.get("warmup", 1)))
        result["step_seconds"] = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
        result["step_ends"] = clock.ends
        result["phases"] = clock.phases
        from rlhf_core.train import generation

        # the decoding the rollouts ended with: a compiled step that failed fell back to the dynamic cache
        result["compile_failure"] = generation._compile_failure[0] if generation._compile_failure else None
        model_params = None
    result["n_params"] = model_params
    result["threads"] = torch.get_num_threads()
    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    if spec["device"] == "cuda":
        result["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        result["device_name"] = torch.cuda.get_device_name()
        result["cuda"] = torch.version.cuda
    return result


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(path).read_text())
    if spec.get("device") == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # our stages pick CUDA whenever one is visible
    result = prep(spec) if mode == "prep" else run(spec)
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
