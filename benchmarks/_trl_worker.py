"""TRL side of ``benchmarks/vs_trl.py``: one timed training run in the TRL virtual environment.

Run by the benchmark with ``.venv-trl/bin/python benchmarks/_trl_worker.py SPEC.json``; never
imported by the project. It imports only torch, transformers, datasets and trl (the project is
not installed in ``.venv-trl``), reads plain paths and numbers from the JSON spec, and prints one
line ``BENCH_RESULT {...}`` on stdout with its timings.

Spec keys: ``stage`` (sft, reward, dpo, ppo), ``model_dir`` (HF causal LM), ``tokenizer_dir``,
``rows`` (JSON file written by the benchmark's preparation step), ``steps``, ``batch_size``,
``micro_batch_size``, ``threads``, ``device`` (cpu, cuda), ``bf16``, ``seed``, ``out_dir``, and
the optimiser, DPO and PPO settings (``learning_rate``, ``adam_eps``, ``weight_decay``,
``scheduler``, ``dpo``: {``beta``}, ``ppo``: {...}).

Timing: a callback takes ``time.perf_counter()`` at the end of every optimiser step (SFT, reward,
DPO) or PPO update; with two or more steps the first is the warm-up and the rate is taken from
the end of step 1 to the end of the last step. With one step, it is timed from its start (SFT,
reward, DPO: ``on_step_begin``; PPO: ``on_train_begin``) and reported as such.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def _marks_callback(marks: dict):
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks.setdefault("train_begin", time.perf_counter())

        def on_step_begin(self, args, state, control, **kwargs):
            marks.setdefault("first_step_begin", time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks.setdefault("step_end", []).append(time.perf_counter())

    return Marks()


class _DtypeProbe:
    """Records the output dtype of one linear layer's first training forward pass (autocast check);
    with ``training_only=False`` its first forward pass in any mode (a frozen reference model)."""

    def __init__(self, module, training_only: bool = True):
        self.dtype = None
        self.training_only = training_only
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.dtype is None and (module.training or not self.training_only):
            self.dtype = str(output.dtype).replace("torch.", "")
            self.handle.remove()


def _autocast_forward(module, device: str) -> None:
    """Run ``module``'s forward passes under bf16 autocast (what accelerate does for mixed precision)."""
    import torch

    module.forward = torch.autocast("cuda" if device == "cuda" else "cpu", dtype=torch.bfloat16)(module.forward)


def _first_linear(model):
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            return module
    raise RuntimeError("no linear layer")


def _common_args(spec: dict, out_dir: str) -> dict:
    """TrainingArguments shared by every stage: no eval, no saving, no logging services, no checkpointing."""
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["batch_size"] // spec["micro_batch_size"],
        learning_rate=spec["learning_rate"],
        adam_epsilon=spec["adam_eps"],
        weight_decay=spec["weight_decay"],
        optim="adamw_torch",  # torch.optim.AdamW, as ours (transformers' default is the fused variant)
        lr_scheduler_type=spec["scheduler"],
        warmup_steps=0,
        bf16=spec["bf16"],
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=spec["device"] == "cpu",
        seed=spec["seed"],
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        push_to_hub=False,
    )


def run_sft(spec: dict, rows: dict, out_dir: str, marks: dict):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype="float32")
    # Pre-tokenised rows (query + reference + EOS, unpadded) in our batch order; loss on every token.
    dataset = Dataset.from_dict({"input_ids": rows["input_ids"]})
    args = SFTConfig(
        **_common_args(spec, out_dir),
        max_steps=spec["steps"],
        max_length=rows["max_length"],
        packing=False,
        padding_free=False,
        pad_to_multiple_of=rows["max_length"] if spec.get("trl_pad_to_max") else None,
        completion_only_loss=None,
        train_sampling_strategy="sequential",  # our batches, in our order
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[_marks_callback(marks)]
    )
    return trainer, model


def run_reward(spec: dict, rows: dict, out_dir: str, marks: dict):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    model = AutoModelForSequenceClassification.from_pretrained(spec["model_dir"], num_labels=1, dtype="float32")
    model.config.pad_token_id = tokenizer.pad_token_id
    dataset = Dataset.from_dict({"chosen_ids": rows["chosen_ids"], "rejected_ids": rows["rejected_ids"]})
    args = RewardConfig(
        **_common_args(spec, out_dir),
        max_steps=spec["steps"],
        max_length=rows["max_length"],
        pad_to_multiple_of=rows["max_length"] if spec.get("trl_pad_to_max") else None,
        disable_dropout=True,
        center_rewards_coefficient=None,
        train_sampling_strategy="sequential",
    )
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[_marks_callback(marks)]
    )
    return trainer, model


#: the pre-tokenised columns DPOTrainer's collator reads (responses without the query, EOS kept)
DPO_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def pretokenized_dpo_trainer():
    """``trl.DPOTrainer`` for rows that are token ids already. TRL 1.12's DPOTrainer always
    extracts a text prompt, appends the EOS text and tokenises (``_prepare_dataset``); its
    collator then reads only ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``. Our rows are
    those columns already (responses ending with our EOS), so they go to the collator as they
    are: no re-tokenisation, no added BOS or EOS. (A function: trl is imported only here.)"""
    from trl import DPOTrainer

    class PreTokenizedDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    return PreTokenizedDPOTrainer


def run_dpo(spec: dict, rows: dict, out_dir: str, marks: dict):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    PreTokenizedDPOTrainer = pretokenized_dpo_trainer()
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype="float32")
    ref_model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype="float32").eval()
    ref_model.requires_grad_(False)  # frozen, as ours
    max_length = rows["max_length"]
    longest = max(len(p) + max(len(c), len(r)) for p, c, r in zip(*(rows[k] for k in DPO_COLUMNS)))
    if longest > max_length:
        raise RuntimeError(f"a row of {longest} tokens would be truncated to max_length {max_length}")
    dataset = Dataset.from_dict({k: rows[k] for k in DPO_COLUMNS})
    args = DPOConfig(
        **_common_args(spec, out_dir),
        max_steps=spec["steps"],
        max_length=max_length,  # our padded length: nothing is truncated (checked above)
        truncation_mode="keep_start",
        padding_free=False,
        pad_to_multiple_of=max_length if spec.get("trl_pad_to_max") else None,
        loss_type=["sigmoid"],
        beta=spec["dpo"]["beta"],
        precompute_ref_log_probs=False,  # reference log-probs per micro-batch, as ours
        use_weighting=False,
        ld_alpha=None,
        sync_ref_model=False,
        use_liger_kernel=False,
        disable_dropout=True,
        train_sampling_strategy="sequential",
    )
    trainer = PreTokenizedDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[_marks_callback(marks)],
    )
    return trainer, model


def run_ppo(spec: dict, rows: dict, out_dir: str, marks: dict):
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    p = spec["ppo"]
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    tokenizer.padding_side = "left"  # queries are left-padded for generation
    load = dict(dtype="float32")
    policy = AutoModelForCausalLM.from_pretrained(spec["model_dir"], **load)
    ref_policy = AutoModelForCausalLM.from_pretrained(spec["model_dir"], **load)
    reward_model = AutoModelForSequenceClassification.from_pretrained(spec["model_dir"], num_labels=1, **load)
    value_model = AutoModelForSequenceClassification.from_pretrained(spec["model_dir"], num_labels=1, **load)
    for m in (reward_model, value_model):
        m.config.pad_token_id = tokenizer.pad_token_id
    if spec["bf16"]:
        # TRL's PPOTrainer builds its Accelerator without mixed precision, so bf16=True is not honoured;
        # run every forward pass (generation included) under bf16 autocast, as ours does and as
        # accelerate does for the Trainer-based SFT and reward stages. TRL calls the value and reward
        # models' backbones and score heads separately, so those are wrapped one by one.
        for module in (
            policy,
            ref_policy,
            reward_model.model,
            reward_model.score,
            value_model.model,
            value_model.score,
        ):
            _autocast_forward(module, spec["device"])
    train = Dataset.from_dict({"input_ids": rows["queries"]})
    evaluation = Dataset.from_dict({"input_ids": rows["queries"][: spec["micro_batch_size"]]})  # never used
    args = PPOConfig(
        **_common_args(spec, out_dir),
        total_episodes=spec["steps"] * spec["batch_size"],
        num_mini_batches=p["num_minibatches"],
        num_ppo_epochs=p["ppo_epochs"],
        local_rollout_forward_batch_size=spec["micro_batch_size"],
        # the same names on both sides
        **{
            key: p[key]
            for key in (
                "response_length",
                "temperature",
                "kl_coef",
                "cliprange",
                "cliprange_value",
                "vf_coef",
                "gamma",
                "lam",
                "whiten_rewards",
            )
        },
        kl_estimator="k1",
        # ours replaces the score of a response without EOS by non_eos_penalty; TRL subtracts this
        missing_eos_penalty=-p["non_eos_penalty"],
        stop_token="eos",
        num_sample_generations=0,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        train_dataset=train,
        value_model=value_model,
        eval_dataset=evaluation,
        callbacks=[_marks_callback(marks)],
    )
    # TRL shuffles prompts; take ours, in our order, so both sides sample the same prompts per update.
    trainer.dataloader = trainer.accelerator.prepare(
        DataLoader(
            train, batch_size=args.local_batch_size, shuffle=False, collate_fn=trainer.data_collator, drop_last=True
        )
    )
    return trainer, policy


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    import trl

    transformers.utils.logging.set_verbosity_error()
    rows = json.loads(open(spec["rows"]).read())
    marks: dict = {}
    with tempfile.TemporaryDirectory(prefix=f"trl-{spec['stage']}-") as out_dir:
        t_load = time.perf_counter()
        trainer, model = {"sft": run_sft, "reward": run_reward, "dpo": run_dpo, "ppo": run_ppo}[spec["stage"]](
            spec, rows, out_dir, marks
        )
        load_seconds = time.perf_counter() - t_load
        probe = _DtypeProbe(_first_linear(model.model if hasattr(model, "model") else model))
        ref_probe = None
        if spec["stage"] == "dpo":  # the frozen reference runs in eval mode, under the same autocast
            ref_probe = _DtypeProbe(_first_linear(trainer.ref_model), training_only=False)
        device_type = "cuda" if spec["device"] == "cuda" else "cpu"
        trainer.train()
    if spec["bf16"] and probe.dtype != "bfloat16":
        raise RuntimeError(f"bf16 requested but a linear layer computed in {probe.dtype}")
    if spec["bf16"] and ref_probe is not None and ref_probe.dtype != "bfloat16":
        raise RuntimeError(f"bf16 requested but a reference model's linear layer computed in {ref_probe.dtype}")
    counted = getattr(trainer, "_total_train_tokens", None)  # DPOTrainer sums each micro-batch's attention mask
    if spec["stage"] == "dpo" and counted != sum(rows["tokens_per_step"]):
        raise RuntimeError(f"DPOTrainer saw {counted} tokens, the rows hold {sum(rows['tokens_per_step'])}")
    ends = marks.get("step_end", [])
    if len(ends) != spec["steps"]:
        raise RuntimeError(f"expected {spec['steps']} step ends, got {len(ends)}")
    if len(ends) >= 2:
        seconds, start_step, warmup_included = ends[-1] - ends[0], 1, False
    else:
        begin = marks.get("first_step_begin", marks.get("train_begin"))
        seconds, start_step, warmup_included = ends[0] - begin, 0, True
    result = {
        "side": "trl",
        "stage": spec["stage"],
        "timed_seconds": seconds,
        "timed_from_step": start_step,  # steps [start_step, steps) are timed, 0-based
        "warmup_included": warmup_included,
        "step_seconds": [b - a for a, b in zip(ends, ends[1:])],
        "load_seconds": load_seconds,
        "n_params": sum(p.numel() for p in model.parameters()),
        "autocast_linear_dtype": probe.dtype,
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
    }
    if ref_probe is not None:
        result.update(ref_autocast_linear_dtype=ref_probe.dtype, trl_counted_tokens=counted)
    if device_type == "cuda":
        result["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
