"""Data parallelism on CPU: 2 ranks (gloo) with half the micro-batch each train exactly like
1 rank with the same global batch (Huang et al. 2024 keep the global batch sizes)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_core.common.tracking import read_metrics
from rlhf_core.models.saved import save_pretrained_atomic
from rlhf_core.ppo.algorithm import masked_mean, masked_mean_var, masked_var, masked_whiten, whiten
from rlhf_core.train.distributed import DataParallel, World, all_gather_cat, all_reduce_sum, shard, split_range
from rlhf_core.train.reward import reward_model_from_causal_lm
from rlhf_core.train.sft import sft_loss_sum
from rlhf_core.train.training import accumulation_steps
from tests.conftest import tiny_llama_config
from tests.stages import link_stages, made_once


def test_shards_split_a_global_batch_evenly_and_in_order():
    batch = list(range(10, 18))
    assert shard(batch, World(0, 2)) + shard(batch, World(1, 2)) == batch
    assert shard(batch, World(0, 1)) == batch
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        shard(batch, World(0, 3))
    assert all_reduce_sum([1.5, 2]) == [1.5, 2.0]  # one process: the identity
    assert accumulation_steps(128, 16, 2) == 4  # the global batch stays 128
    with pytest.raises(ValueError, match="x 3 rank"):
        accumulation_steps(128, 16, 3)
    # evaluation prompts need not split evenly: contiguous, covering, the first ranks one more
    parts = [split_range(7, World(r, 3)) for r in range(3)]
    assert [list(p) for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert list(split_range(1, World(1, 2))) == []


def _rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent advantages: rank 1's are shifted and scaled, and it has fewer valid positions."""
    g = torch.Generator().manual_seed(rank)
    values = torch.randn(3, 5, generator=g) * (1 + 2 * rank) + 4 * rank
    lengths = torch.tensor([4, 2, 0]) if rank else torch.tensor([4, 4, 3])
    mask = torch.arange(5).unsqueeze(0) <= lengths.unsqueeze(1)
    return values, mask


def _whiten_on_rank(rank: int, world_size: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        values, mask = _rank_batch(rank)
        whitened = whiten(values, *masked_mean_var(values, mask)) * mask
        torch.save(
            {
                "global": all_gather_cat(whitened),
                "mask": all_gather_cat(mask),
                "local": masked_whiten(values, mask) * mask,
            },
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.heavy
def test_advantage_whitening_uses_the_global_batch_over_two_ranks(tmp_path):
    """Detail 25 under data parallelism: each rank's share, whitened with the statistics of all
    ranks (gloo), gives the global batch mean 0 and variance 1, the same as whitening the
    concatenated batch in one process; whitening per rank would not."""
    mp.spawn(_whiten_on_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    whitened, mask = got[0]["global"], got[0]["mask"]
    torch.testing.assert_close(got[1]["global"], whitened)  # every rank sees the same statistics
    assert masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, rel=1e-5)
    values = torch.cat([_rank_batch(r)[0] for r in range(2)])
    torch.testing.assert_close(whitened, masked_whiten(values, mask) * mask, rtol=1e-5, atol=1e-5)
    per_rank = torch.cat([got[0]["local"], got[1]["local"]])
    assert not torch.allclose(per_rank, whitened, atol=1e-2)  # the test can tell the two apart


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=32, tie_word_embeddings=True))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's full gradient (a sharded one gathered from every rank)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _data_parallel_on_rank(rank: int, world_size: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        ids = torch.randint(1, 32, (8, 7), generator=torch.Generator().manual_seed(1))  # the global batch
        mask = torch.ones_like(ids, dtype=torch.bool)
        n_targets = int(mask[:, 1:].sum())
        reference = _tiny_llama()  # one process, the whole global batch
        sft_loss_sum(reference, ids, mask, 0)[0].div(n_targets).backward()
        results = {"reference": _grads(reference)}
        mine = shard(list(range(8)), World(rank, world_size))
        for strategy in ("ddp", "zero2", "fsdp"):
            model = _tiny_llama()
            parallel = DataParallel(model, strategy)
            after_first = None
            for mb in parallel.accumulate([mine[:2], mine[2:]]):  # 2 micro-batches of 2 rows per rank
                loss_sum, _ = parallel(sft_loss_sum, ids[mb], mask[mb], 0)
                (loss_sum / n_targets).backward()
                if after_first is None and strategy == "ddp":
                    after_first = _grads(model)
            results[strategy] = _grads(model)
            results[f"{strategy}/wrapper"] = type(parallel._forward).__name__
            if after_first is not None:
                results["ddp/after_first"] = after_first
        local = _tiny_llama()  # this rank's first micro-batch alone
        sft_loss_sum(local, ids[mine[:2]], mask[mine[:2]], 0)[0].div(n_targets).backward()
        results["local_first"] = _grads(local)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.heavy
def test_data_parallel_sums_gradients_over_ranks_once_per_global_batch(tmp_path):
    """``DataParallel`` on 2 gloo ranks, each with half the global batch in 2 micro-batches:
    after the last micro-batch every parameter's gradient equals one process's gradient of the
    global batch's mean (the sum over ranks, not DDP's default average), for DDP, ZeRO-2 and
    FSDP (FSDP2). DDP communicates only in the last micro-batch's backward pass (``no_sync``
    before it): after the first, each rank holds its own gradient."""
    mp.spawn(_data_parallel_on_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert got[0]["ddp/wrapper"] == "DistributedDataParallel"
    assert got[0]["fsdp/wrapper"] == got[0]["zero2/wrapper"] == "FSDP_TrainingForward"
    reference = got[0]["reference"]
    for strategy in ("ddp", "zero2", "fsdp"):
        for r in range(2):
            assert got[r][strategy].keys() == reference.keys()
            for name, grad in reference.items():
                torch.testing.assert_close(got[r][strategy][name], grad, rtol=1e-5, atol=1e-7, msg=f"{strategy} {name}")
    for r in range(2):
        for name, grad in got[r]["local_first"].items():
            torch.testing.assert_close(got[r]["ddp/after_first"][name], grad, rtol=1e-5, atol=1e-7)
    emb = "model.embed_tokens.weight"
    assert not torch.allclose(got[0]["local_first"][emb], got[1]["local_first"][emb])  # the ranks' parts differ


@pytest.fixture(scope="module")
def inputs(smoke_stages, shared_runs):
    """The stages' inputs, made once for all test processes (the runs below are shared too)."""

    def build(root):
        link_stages(smoke_stages, root, data="data", base="base")
        shutil.copytree(root / "base", root / "sft" / "model")  # the reward model starts from a policy's `model`
        save_pretrained_atomic(reward_model_from_causal_lm(root / "base", seed=3), root / "reward" / "model")

    return made_once(shared_runs, "ddp-inputs", build)


def launch(
    stage: str,
    inputs: list,
    out,
    ranks: int,
    *overrides: str,
    expect: str = "",
    expect_times: int | None = None,
    expect_also: tuple[str, ...] = (),
) -> list[tuple[int, dict]]:
    """Run ``stage`` under ``torchrun`` on ``ranks`` gloo ranks and return its metrics; the output
    must hold ``expect`` (exactly ``expect_times`` times when given) and each of ``expect_also``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "rlhf_core.run.launch",
        stage,
        "--preset",
        "smoke",
        "--inputs",
        *map(str, inputs),
        "--out",
        str(out),
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    output = result.stdout + result.stderr
    assert expect in output
    assert all(text in output for text in expect_also), output[-4000:]
    if expect_times is not None:
        assert output.count(expect) == expect_times, output[-4000:]
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("stage,strategy", [("sft", "ddp"), ("reward", "ddp"), ("sft", "fsdp"), ("reward", "zero2")])
def test_two_ranks_with_half_the_micro_batch_match_one_rank(stage, strategy, inputs, shared_runs, tmp_path):
    """DDP sums full gradients; ZeRO-2 and FSDP (PyTorch FSDP2) shard gradients and optimiser
    state (FSDP the parameters too). Each must train like one process, checkpoint the full
    state from all ranks, and save a full model from rank 0. The one process's run is made once
    per stage, for every strategy."""
    if stage == "sft":
        stage_inputs, extra = [inputs / "data", inputs / "base"], ["sft.max_steps=3", "sft.eval_max_samples=1"]
    else:
        stage_inputs, extra = [inputs / "data", inputs / "sft"], ["reward.max_steps=3"]
    # float32 on every machine: the equality below is of float32 sums in another order; bf16
    # autocast (what `auto` picks on a CPU with native bf16) rounds each product to 8 bits
    extra.append(f"{stage}.bf16=false")
    reference = made_once(
        shared_runs,
        f"{stage}-one-rank",
        lambda out: launch(stage, stage_inputs, out, 1, f"{stage}.micro_batch_size=4", *extra),
    )
    (tmp_path / "one").symlink_to(reference, target_is_directory=True)
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    two = launch(
        stage,
        stage_inputs,
        tmp_path / "two",
        2,
        f"{stage}.micro_batch_size=2",
        f"{stage}.strategy={strategy}",
        *extra,
        expect="" if strategy == "ddp" else f"{strategy}: 2 blocks sharded over 2 ranks",
    )
    losses = [[m["train/loss"] for step, m in run if "train/loss" in m] for run in (one, two)]
    assert len(losses[0]) == 3 and len(losses[1]) == 3
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)
    assert losses[0][0] != losses[0][-1]  # it trained
    tokens = [[m["tokens_per_s"] > 0 for step, m in run if "train/loss" in m] for run in (one, two)]
    assert all(tokens[0]) and all(tokens[1])
    assert (tmp_path / "two" / "model").is_dir() and not (tmp_path / "two" / "checkpoints" / "step-000004").exists()
    # the checkpoint after step 2 holds full tensors, equal to the single process's
    states = [
        torch.load(tmp_path / run / "checkpoints" / "step-000002" / "state.pt", weights_only=False)
        for run in ("one", "two")
    ]
    assert states[1]["model"].keys() == states[0]["model"].keys()
    for name, tensor in states[0]["model"].items():
        torch.testing.assert_close(states[1]["model"][name], tensor, rtol=1e-4, atol=1e-5)
    # and the saved models are the same full models
    from safetensors.torch import load_file

    saved = [load_file(next((tmp_path / run / "model").glob("*.safetensors"))) for run in ("one", "two")]
    assert saved[1].keys() == saved[0].keys()
    for name, tensor in saved[0].items():
        torch.testing.assert_close(saved[1][name], tensor, rtol=1e-4, atol=1e-5)


#: PPO on 2 ranks: 2 updates of 8 prompts, 4 per rank in micro-batches of 2; 5 evaluation prompts
#: (3 + 2 over the ranks: 2 micro-batches on rank 0, 1 on rank 1); float32, so that strategies
#: compare to rounding.
PPO_TWO_RANKS = (
    "ppo.total_episodes=16",
    "ppo.micro_batch_size=2",
    "ppo.eval_every=2",
    "ppo.eval_max_samples=5",
    "ppo.checkpoint_every=1",
    "ppo.bf16=false",
)


@pytest.fixture(scope="module")
def ppo_ddp(inputs, shared_runs):
    """PPO on 2 ranks under DDP, made once for all test processes: its output directory and metrics."""
    stages = [inputs / "data", inputs / "sft", inputs / "reward"]
    out = made_once(shared_runs, "ppo-ddp", lambda out: launch("ppo", stages, out, 2, *PPO_TWO_RANKS))
    return out, read_metrics(out / "metrics.jsonl")


@pytest.mark.slow
def test_ppo_runs_on_two_ranks_with_globally_whitened_advantages(ppo_ddp):
    """PPO under torchrun with 2 gloo ranks: each samples and trains on half of every update's
    prompts; the logged statistics are those of the gathered global batch, whose whitened
    advantages have mean 0 and variance 1; rank 0 alone saves."""
    out, metrics = ppo_ddp
    updates = [m for step, m in metrics if "advantages/mean" in m]
    assert len(updates) == 2
    for m in updates:
        assert m["advantages/mean"] == pytest.approx(0.0, abs=1e-5)
        assert m["advantages/var"] == pytest.approx(1.0, rel=1e-3)
        assert m["episodes"] in (8.0, 16.0)
        assert all(v == v for v in m.values())  # no NaN
    assert updates[0]["loss/policy"] != updates[1]["loss/policy"]
    assert (out / "model" / "config.json").is_file() and (out / "value_model" / "config.json").is_file()
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 5  # the 5 evaluation prompts, split 3 + 2 over the ranks and gathered
    # Detail 22 / Figure 11 on rank 0's summaries: the policy and the reference read there too
    figure = json.loads((out / "value_vs_reward.json").read_text())["responses"]
    assert len(figure) == 3 and all(len(r["rewards"]) == r["eos_index"] + 1 for r in figure)
    assert any(v != 0 for r in figure for v in r["kl_penalty"])  # trained: the policy has moved from SFT
    assert (out / "checkpoints" / "step-000001" / "state.pt").is_file()
    state = torch.load(out / "checkpoints" / "step-000001" / "state.pt", weights_only=False)
    rngs = state["extra"]["rank_rng"]
    assert len(rngs) == 2 and not torch.equal(rngs[0], rngs[1])  # each rank's own sampling stream


@pytest.mark.slow
def test_rloo_on_two_ranks_keeps_each_prompts_samples_on_one_rank(inputs, tmp_path):
    """RLOO under torchrun with 2 gloo ranks: 8 episodes per update are 4 prompts x 2 samples, 2
    prompts per rank, and each rank's baselines are over whole groups (the trainer refuses a group
    that holds two prompts, rlhf_core.ppo.algorithm.estimate_advantages); no value model is held,
    checkpointed or saved."""
    out = tmp_path / "ppo"
    rloo = ("ppo.advantage_estimator=rloo", "ppo.samples_per_prompt=2")
    metrics = launch("ppo", [inputs / "data", inputs / "sft", inputs / "reward"], out, 2, *PPO_TWO_RANKS, *rloo)
    updates = [m for step, m in metrics if "loss/policy" in m]
    assert len(updates) == 2 and [m["episodes"] for m in updates] == [8.0, 16.0]
    assert updates[0]["loss/policy"] != updates[1]["loss/policy"]
    assert not any("loss/value" in m or "returns/mean" in m for m in updates)
    assert all(v == v for m in updates for v in m.values())  # no NaN
    assert (out / "model" / "config.json").is_file() and not (out / "value_model").exists()
    state = torch.load(out / "checkpoints" / "step-000001" / "state.pt", weights_only=False)
    assert state["model"] and all(name.startswith("policy.") for name in state["model"])


def _safetensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(next(directory.glob("*.safetensors")))


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,offload,expect,expect_times",
    [
        ("fsdp", False, "fsdp: 2 blocks sharded over 2 ranks", 4),
        ("zero2", False, "zero2: 2 blocks sharded over 2 ranks", 2),
        # the policy read back from each sharded module: 2 blocks and the whole model, 2 frozen models
        ("fsdp", True, "kept in CPU memory (CPUOffloadPolicy on 3 of 3 sharded modules)", 2),
    ],
    ids=["fsdp", "zero2", "fsdp-offload"],
)
def test_sharded_ppo_on_two_ranks_trains_as_ddp(strategy, offload, expect, expect_times, ppo_ddp, inputs, tmp_path):
    """PPO with the policy and value model sharded (ZeRO-2: gradients and optimiser state; FSDP2:
    parameters too, and the frozen reference and reward models: 4 sharded models, 2 under
    ZeRO-2) on the same 2 ranks as DDP, each rank with its own sampling seed: the same samples,
    per-update losses, statistics and evaluation (whose 5 prompts split 3 + 2: the ranks
    summarise in different numbers of forward passes, so a sharded policy is gathered first),
    the same full checkpoint, and the same saved policy and value model. (One rank with the
    global batch samples other responses: each rank has its own sampling stream.) With
    ``ppo.offload_frozen`` under FSDP2 the two frozen models' shards live in CPU memory
    (Detail 8, FSDP2's ``CPUOffloadPolicy``), with the same results."""
    ddp_out, ddp = ppo_ddp
    out = tmp_path / "ppo"
    got = launch(
        "ppo",
        [inputs / "data", inputs / "sft", inputs / "reward"],
        out,
        2,
        *PPO_TWO_RANKS,
        f"ppo.strategy={strategy}",
        f"ppo.offload_frozen={str(offload).lower()}",
        expect=expect,
        expect_times=expect_times,
        # the policy, gathered for its rollouts, is still an FSDP2 module: no CUDA graph on memory gathered anew
        expect_also=("generate: decoding with the dynamic KV cache, for a model sharded by FSDP2",),
    )
    updates = [[m for step, m in run if "loss/policy" in m] for run in (ddp, got)]
    assert len(updates[0]) == len(updates[1]) == 2
    keys = ["loss/policy", "loss/value", "policy/approxkl", "objective/scores", "objective/kl", "val/ratio"]
    keys += ["eval/score_policy", "eval/raw_score_policy", "eval/score_reference"]
    assert "eval/score_policy" in updates[0][1]  # the second update evaluates
    for want, have in zip(*updates):
        assert have.keys() == want.keys()
        for key in keys:
            if key in want:
                assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    assert updates[0][0]["loss/value"] != updates[0][1]["loss/value"]  # it trained
    samples = [
        [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()] for run in (ddp_out, out)
    ]
    # the KL from SFT of each summary: log-probabilities of gathered shards, equal up to rounding
    kls = [[row.pop("kl_vs_sft") for row in rows] for rows in samples]
    assert kls[1] == pytest.approx(kls[0], rel=1e-4, abs=1e-4)
    # the value plot's rows (Detail 22, Figure 11): the four models gathered whole, the same figures
    figures = [json.loads((run / "value_vs_reward.json").read_text())["responses"] for run in (ddp_out, out)]
    assert len(figures[1]) == len(figures[0]) == 3
    for want, have in zip(*figures):
        for key in ("values", "reward_logits", "kl_penalty", "rewards", "ppo_values"):
            assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-4), key
    assert samples[1] == samples[0] and len(samples[0]) == 5
    states = [
        torch.load(run / "checkpoints" / "step-000001" / "state.pt", weights_only=False) for run in (ddp_out, out)
    ]
    assert states[1]["model"].keys() == states[0]["model"].keys()
    for name, tensor in states[0]["model"].items():
        torch.testing.assert_close(states[1]["model"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert len(states[1]["optimizer"]["state"]) == len(states[0]["optimizer"]["state"])
    for model in ("model", "value_model"):
        saved = [_safetensors(run / model) for run in (ddp_out, out)]
        assert saved[1].keys() == saved[0].keys()
        for name, tensor in saved[0].items():
            torch.testing.assert_close(saved[1][name], tensor, rtol=1e-4, atol=1e-5, msg=f"{model} {name}")
