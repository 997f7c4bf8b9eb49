"""TRL's sigmoid DPO loss and implicit rewards on fixed summed log-probabilities, computed by TRL's own code.

Run in the TRL virtual environment (``make bench-venv-trl``; the project is not installed there)::

    .venv-trl/bin/python benchmarks/dpo_loss_vs_trl.py

It writes ``benchmarks/results/dpo_loss_vs_trl.json``: the inputs (summed log-probabilities of
chosen and rejected responses under the policy and the reference, float32), each ``beta``, and
TRL's outputs at full float precision: the loss and the chosen and rejected rewards of every pair,
and the loss and reward means of the whole batch. ``tests/benchmarks/test_dpo_loss_vs_trl.py``
(in ``.venv``, without TRL) asserts that :func:`rlhf_core.train.dpo.dpo_loss` returns the same values.

Inputs: 16 pairs drawn from a seeded generator (reference log-probabilities in [-200, -20] nats,
the policy's within a few nats of them), plus hand-picked extremes: equal log-probabilities
(loss log 2), margins large enough to saturate the sigmoid either way, a zero log-probability,
log-ratios that nearly cancel at large magnitude, and log-probabilities of -1e4.

What TRL code runs: TRL 1.12 has no separate function for the DPO loss; it is inline in
``trl.trainer.dpo_trainer.DPOTrainer._compute_loss`` (``per_sequence_loss =
-F.logsigmoid(self.beta * delta_score)`` for ``loss_type="sigmoid"``, ``delta_score`` the
difference of the chosen and rejected log-ratios under ``f_divergence_type="reverse_kl"``; the
rewards are ``self.beta * chosen_logratios`` and ``self.beta * rejected_logratios``, logged as
``rewards/chosen`` and ``rewards/rejected``). So the script builds a real ``DPOTrainer`` (a tiny
random Llama for policy and reference, a six-token word-level tokenizer, ``loss_type="sigmoid"``,
``precompute_ref_log_probs=False``, float32 on the CPU), collates one-token responses with TRL's
``DataCollatorForPreference``, and calls ``DPOTrainer.compute_loss`` (which calls
``_compute_loss``) unchanged. Only the per-token log-probability function it calls,
``selective_log_softmax`` in the ``trl.trainer.dpo_trainer`` namespace, is replaced: its first
call of a batch (the policy) and its second (the reference) return zeros but at the response
token, where they hold the fixed log-probability, so TRL's masked sum over the response is that
value exactly (checked against TRL's logged ``logps/chosen`` and ``logps/rejected``). The dataset
preparation is bypassed, as in ``benchmarks/_trl_worker.py`` (``_prepare_dataset`` returns the
pre-tokenised rows). Each pair goes through ``compute_loss`` alone (its loss is then the pair's
loss and its logged rewards the pair's rewards), and the whole set once as one batch (the mean
loss). The JSON records the TRL, transformers and torch versions, the SHA-256 of TRL's
``dpo_trainer.py`` and the line of the sigmoid loss in it; the script fails if that line is not
in ``_compute_loss``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import inspect
import json
import platform
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "dpo_loss_vs_trl.json"
BETAS = (0.05, 0.1, 0.5)  # Table 6's beta, TRL's default, and a larger one
SIGMOID_LINE = "per_sequence_loss = -F.logsigmoid(self.beta * delta_score)"
NAMES = ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps")

#: (label, policy chosen, policy rejected, reference chosen, reference rejected), nats
EXTREMES = [
    ("equal log-probabilities: loss log 2", -50.0, -50.0, -50.0, -50.0),
    ("large positive margin: loss underflows to 0", -10.0, -2000.0, -2000.0, -10.0),
    ("large negative margin: loss = beta * margin", -2000.0, -10.0, -10.0, -2000.0),
    ("zero log-probability (policy sure of the chosen response)", 0.0, -5.0, -1.0, -3.0),
    ("log-ratios that nearly cancel at large magnitude", -1000.5, -3000.0, -2000.25, -4000.0),
    ("log-probabilities of -1e4", -1.0e4, -1.0e4 + 3.0, -1.0e4 + 1.0, -1.0e4),
    ("moderate margin of 40 nats", -30.0, -70.0, -50.0, -50.0),
]


def inputs(n_random: int, seed: int) -> tuple[list[str], dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ref_c = -(20.0 + 180.0 * torch.rand(n_random, generator=g))
    ref_r = -(20.0 + 180.0 * torch.rand(n_random, generator=g))
    pol_c = ref_c + 4.0 * torch.randn(n_random, generator=g)
    pol_r = ref_r + 4.0 * torch.randn(n_random, generator=g)
    labels = [f"random {i}" for i in range(n_random)] + [e[0] for e in EXTREMES]
    columns = [pol_c, pol_r, ref_c, ref_r]
    values = {
        name: torch.cat([col, torch.tensor([e[k + 1] for e in EXTREMES])]).to(torch.float32)
        for k, (name, col) in enumerate(zip(NAMES, columns))
    }
    return labels, values


def tiny_trainer(beta: float, batch: int, out_dir: str):
    """A real DPOTrainer on a tiny random Llama, taking pre-tokenised rows (one-token responses)."""
    import torch
    from _trl_worker import pretokenized_dpo_trainer  # the benchmark's: rows of token ids, as they are
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig

    PreTokenizedDPOTrainer = pretokenized_dpo_trainer()
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, "a": 3, "b": 4, "c": 5}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="</s>",
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model, ref_model = LlamaForCausalLM(config), LlamaForCausalLM(config)
    rows = {"prompt_ids": [[3, 4]], "chosen_ids": [[2]], "rejected_ids": [[5]]}
    args = DPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        beta=beta,
        loss_type=["sigmoid"],
        f_divergence_type="reverse_kl",
        label_smoothing=0.0,
        use_weighting=False,
        ld_alpha=None,
        precompute_ref_log_probs=False,
        use_liger_kernel=False,
        max_length=None,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = PreTokenizedDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
    )
    trainer.model.train()
    return trainer, {k: v[0] for k, v in rows.items()}


def trl_outputs(beta: float, values: dict) -> dict:
    """TRL's losses and rewards per pair (one pair per ``compute_loss`` call) and over the batch."""
    import torch
    import trl.trainer.dpo_trainer as dpo_module

    n = len(values[NAMES[0]])
    queue: list = []
    original = dpo_module.selective_log_softmax

    def fixed_logps(logits, labels):
        """Zeros but at the last position (the one-token response): the queued summed log-probs."""
        rows = queue.pop(0)
        if rows.shape != labels.shape[:1] or labels.shape[1] != 2:  # prompt 2 + response 1, shifted
            raise RuntimeError(f"unexpected batch layout {tuple(labels.shape)}")
        out = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
        out[:, -1] = rows
        return out

    def run(trainer, example, index) -> tuple[float, dict]:
        policy = torch.cat([values["policy_chosen_logps"][index], values["policy_rejected_logps"][index]])
        ref = torch.cat([values["ref_chosen_logps"][index], values["ref_rejected_logps"][index]])
        queue[:] = [policy, ref]  # _compute_loss: the policy's log-probs first, then the reference's
        inputs = trainer._prepare_inputs(trainer.data_collator([example] * len(index)))
        loss = trainer.compute_loss(trainer.model, inputs)
        if queue:
            raise RuntimeError("compute_loss did not take the policy's and the reference's log-probs")
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
        # TRL's masked sum over the response recovered exactly the injected log-probabilities
        for side, name in (("chosen", "policy_chosen_logps"), ("rejected", "policy_rejected_logps")):
            if metrics[f"logps/{side}"] != values[name][index].mean().item():
                raise RuntimeError(f"TRL's logps/{side} {metrics[f'logps/{side}']} is not the injected value")
        return loss.item(), metrics

    dpo_module.selective_log_softmax = fixed_logps
    try:
        with tempfile.TemporaryDirectory(prefix="dpo-loss-") as tmp:
            trainer, example = tiny_trainer(beta, 1, tmp)
            losses, chosen, rejected = [], [], []
            for i in range(n):
                loss, metrics = run(trainer, example, torch.tensor([i]))
                losses.append(loss)
                chosen.append(metrics["rewards/chosen"])
                rejected.append(metrics["rewards/rejected"])
            batch_loss, batch_metrics = run(trainer, example, torch.arange(n))
    finally:
        dpo_module.selective_log_softmax = original
    return {
        "beta": beta,
        "losses": losses,
        "chosen_rewards": chosen,
        "rejected_rewards": rejected,
        "batch": {
            "loss": batch_loss,
            "rewards/chosen": batch_metrics["rewards/chosen"],
            "rewards/rejected": batch_metrics["rewards/rejected"],
            "rewards/margins": batch_metrics["rewards/margins"],
            "rewards/accuracies": batch_metrics["rewards/accuracies"],
        },
    }


def trl_source() -> dict:
    """Where the sigmoid loss is in the installed TRL, and that ``_compute_loss`` holds it."""
    import trl.trainer.dpo_trainer as dpo_module
    from trl import DPOTrainer

    path = Path(dpo_module.__file__)
    text = path.read_text()
    lines, first = inspect.getsourcelines(DPOTrainer._compute_loss)
    hits = [first + k for k, line in enumerate(lines) if line.strip() == SIGMOID_LINE]
    if len(hits) != 1:
        raise SystemExit(f"{path}: DPOTrainer._compute_loss does not hold `{SIGMOID_LINE}` once; TRL changed")
    return {
        "entry_point": "trl.DPOTrainer.compute_loss -> DPOTrainer._compute_loss (unmodified)",
        "replaced": "trl.trainer.dpo_trainer.selective_log_softmax: returns the fixed per-token log-probs",
        "file": f"trl/trainer/{path.name}",
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "compute_loss_lines": [first, first + len(lines) - 1],
        "sigmoid_loss_line": hits[0],
        "sigmoid_loss_source": SIGMOID_LINE,
        "rewards_source": "chosen_rewards = self.beta * chosen_logratios.detach(); "
        "rejected_rewards = self.beta * rejected_logratios.detach()",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=16, help="random pairs (the extremes are added)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)

    import accelerate
    import torch
    import transformers
    import trl

    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed-argument notices
    torch.set_num_threads(1)
    labels, values = inputs(args.pairs, args.seed)
    record = {
        "what": "TRL's sigmoid DPO loss and implicit rewards on fixed summed log-probabilities (float32); "
        "tests/benchmarks/test_dpo_loss_vs_trl.py checks rlhf_core.train.dpo.dpo_loss against them",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python benchmarks/dpo_loss_vs_trl.py", *(argv if argv is not None else sys.argv[1:])]),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "accelerate": accelerate.__version__,
            "python": platform.python_version(),
        },
        "trl_code": trl_source(),
        "seed": args.seed,
        "labels": labels,
        "inputs": {name: values[name].tolist() for name in NAMES},
        "cases": [trl_outputs(beta, values) for beta in BETAS],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for case in record["cases"]:
        print(f"beta {case['beta']}: mean loss {case['batch']['loss']:.6f} over {len(labels)} pairs")
    print(
        f"wrote {args.out} (TRL {trl.__version__}, {record['trl_code']['file']} line "
        f"{record['trl_code']['sigmoid_loss_line']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
