"""Mid-stage checkpoints: their cadence in steps or minutes (the same decision on every rank),
the one complete checkpoint kept, and the settings that choose them."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_core.config.presets import available_presets, load_config
from rlhf_core.config.settings import ConfigError, EpochTrainerConfig
from rlhf_core.train import training
from rlhf_core.train.trainer import train_loop
from rlhf_core.train.training import CheckpointManager, StepProgress, micro_batches

TRAINERS = ("sft", "reward", "dpo", "ppo")


# ------------------------------------------------------------------------------ settings


def test_the_default_cadence_is_30_minutes_with_one_checkpoint_kept_and_steps_take_precedence():
    cfg = load_config(None)
    for name in TRAINERS:
        section = getattr(cfg, name)
        assert (section.checkpoint_every, section.checkpoint_every_minutes, section.keep_checkpoints) == (None, 30.0, 1)
    # an override in steps replaces a time cadence (the default's or a preset's) without more keys
    assert load_config("cpu-demo", ["ppo.checkpoint_every=1"]).ppo.checkpoint_every == 1
    demo, smoke = load_config("cpu-demo"), load_config("smoke")
    for name in TRAINERS:
        assert getattr(demo, name).checkpoint_every is None and getattr(demo, name).checkpoint_every_minutes == 5
        assert getattr(smoke, name).checkpoint_every == 2  # the kill-and-resume tests wait for step 2
    gpu_presets = sorted(set(available_presets()) - {"smoke", "cpu-demo"})  # every other preset, new ones too
    assert {"pythia-6.9b", "pythia-6.9b-1gpu", "llama-3.2-1b-lora"} <= set(gpu_presets)
    for preset in gpu_presets:
        assert all(getattr(load_config(preset), name).checkpoint_every is None for name in TRAINERS), preset


def test_a_cadence_must_be_set_and_the_settings_are_checked():
    with pytest.raises(
        ConfigError, match=r"ppo\.checkpoint_every_minutes: checkpoint_every and checkpoint_every_minutes are both null"
    ):
        load_config(None, ["ppo.checkpoint_every_minutes=null"])
    with pytest.raises(
        ConfigError, match=r"sft\.checkpoint_every_minutes: checkpoint_every and checkpoint_every_minutes"
    ):
        load_config("smoke", ["sft.checkpoint_every=null", "sft.checkpoint_every_minutes=null"])
    assert load_config("smoke", ["sft.checkpoint_every_minutes=null"]).sft.checkpoint_every == 2  # steps alone
    for bad in ("dpo.checkpoint_every_minutes=0", "dpo.keep_checkpoints=0", "dpo.checkpoint_every=0"):
        with pytest.raises(ConfigError, match=bad.partition("=")[0].replace(".", r"\.")):
            load_config(None, [bad])
    with pytest.raises(ValueError, match="set checkpoint_every or checkpoint_every_minutes"):
        StepProgress("sft", 4, 0, None, print, None, Path("ckpt"))


# ------------------------------------------------------------------------------- cadence


class FakeClock:
    """Seconds that pass only when the test says: ``advance(s)``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run_steps(total: int, step_seconds: float, save_seconds: float, clock, **cadence) -> list[int]:
    """Report ``total`` steps of ``step_seconds`` each to a :class:`StepProgress`; a save takes
    ``save_seconds``. Returns the steps after which it saved."""
    saved: list[int] = []

    def save(done: int) -> None:
        saved.append(done)
        clock.advance(save_seconds)

    progress = StepProgress(
        "sft", total, 0, None, save, cadence.pop("every", None), Path("ckpt"), clock=clock, **cadence
    )
    for done in range(1, total + 1):
        clock.advance(step_seconds)
        progress.report(done, {"loss": 0.0}, {})
    progress.close()
    return saved


def test_a_time_cadence_saves_once_the_minutes_have_passed_since_the_last_checkpoint_ended():
    """Steps of 25 s, saves of 50 s, a checkpoint every minute: after steps 3 (75 s in), 6 (75
    s after the first save ended) and 9; never after the last step."""
    assert run_steps(10, 25, 50, FakeClock(), checkpoint_every_minutes=1) == [3, 6, 9]
    assert run_steps(9, 25, 50, FakeClock(), checkpoint_every_minutes=1) == [3, 6]
    assert run_steps(10, 1, 0, FakeClock(), checkpoint_every_minutes=1) == []  # 10 s in all
    # the step count, when set, takes precedence
    assert run_steps(10, 25, 50, FakeClock(), every=4, checkpoint_every_minutes=1) == [4, 8]


def test_a_time_cadence_counts_from_the_start_of_a_resumed_attempt():
    clock, saved = FakeClock(), []
    clock.advance(10_000)  # long after the first attempt began
    progress = StepProgress(
        "sft", 10, 6, None, saved.append, None, Path("ckpt"), checkpoint_every_minutes=1, clock=clock
    )
    for done in range(7, 11):
        clock.advance(25)
        progress.report(done, {"loss": 0.0}, {})
    assert saved == [9]


def _cadence_on_rank(rank: int, world_size: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        calls = [0]
        reduce = training.all_reduce_sum

        def counted(values):
            calls[0] += 1
            return reduce(values)

        training.all_reduce_sum = counted
        # rank 0's clock: 25 s a step; any other rank's runs 100 times faster: only rank 0's counts
        clock = FakeClock()
        by_time = run_steps(10, 25 if rank == 0 else 2500, 0, clock, checkpoint_every_minutes=1)
        time_calls, calls[0] = calls[0], 0
        by_steps = run_steps(10, 25, 0, FakeClock(), every=4)
        torch.save(
            {"time": by_time, "time_calls": time_calls, "steps": by_steps, "step_calls": calls[0]},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.heavy
def test_every_rank_saves_when_rank_0s_clock_says_and_a_step_cadence_needs_no_communication(tmp_path):
    """Under torchrun the ranks save together (saving is collective): rank 0's clock decides and
    a sum over the ranks carries its decision to the others, once a step; a step cadence is
    decided by each rank alone, with no communication."""
    mp.spawn(_cadence_on_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:
        assert got["time"] == [3, 6, 9]  # rank 0's 75 s; rank 1's own clock would say every step
        assert got["time_calls"] == 9  # one sum per step but the last
        assert got["steps"] == [4, 8] and got["step_calls"] == 0


# ------------------------------------------------------------------------------- on disk


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """A small model, its AdamW (one step taken, so it has moments) and a schedule."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _loaded(manager: CheckpointManager) -> tuple[dict | None, dict[str, torch.Tensor]]:
    model, optimizer, scheduler = _trained(99)
    resumed = manager.load_latest(model, optimizer, scheduler)
    return resumed, {k: v.clone() for k, v in model.state_dict().items()}


def _everything(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_one_complete_checkpoint_is_kept_by_default(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", "digest")
    for step in (2, 4, 6):
        model, optimizer, scheduler = _trained(step)
        manager.save(step, model, optimizer, scheduler)
    assert _everything(tmp_path / "ckpt") == ["step-000006", "step-000006/state.pt"]
    resumed, weights = _loaded(manager)
    assert resumed["step"] == 6
    for name, tensor in _trained(6)[0].state_dict().items():
        assert torch.equal(weights[name], tensor)
    two = CheckpointManager(tmp_path / "two", "digest", keep=2)
    for step in (2, 4, 6):
        two.save(step, *_trained(step))
    assert [p.name for p in two.checkpoints()] == ["step-000004", "step-000006"]


def test_a_save_that_fails_part_way_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    """The new checkpoint is complete on disk before the old one is removed: a write that fails
    half way (a full disk) leaves the previous checkpoint as it was, and nothing partial."""
    manager = CheckpointManager(tmp_path / "ckpt", "digest")
    first = _trained(2)
    manager.save(2, *first)
    real_save = torch.save

    def half_written(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(OSError, match="No space left"):
        manager.save(4, *_trained(4))
    monkeypatch.setattr(torch, "save", real_save)
    assert _everything(tmp_path / "ckpt") == ["step-000002", "step-000002/state.pt"]
    resumed, weights = _loaded(manager)
    assert resumed["step"] == 2
    for name, tensor in first[0].state_dict().items():
        assert torch.equal(weights[name], tensor)


#: A process that saves the checkpoint of step argv[2] under argv[1] and is killed (SIGKILL)
#: half way through writing it.
KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
import torch
from rlhf_core.train.training import CheckpointManager
from tests.rlhf_core.train.test_checkpoints import _trained

def half_written(obj, path, *args, **kwargs):
    Path(path).write_bytes(b"PK half a checkpoint")
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = half_written
CheckpointManager(sys.argv[1], "digest").save(int(sys.argv[2]), *_trained(5))
"""


@pytest.mark.parametrize("step", [4, 2])
@pytest.mark.heavy
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_loadable(step, tmp_path):
    """SIGKILL half way through writing a checkpoint, of a new step or of the step already saved
    (a failure right after a resume saves that step again): the previous checkpoint loads, with
    its weights, and the next save removes what the killed one left."""
    import subprocess
    import sys

    manager = CheckpointManager(tmp_path / "ckpt", "digest")
    first = _trained(2)
    manager.save(2, *first)
    repo = Path(__file__).resolve().parents[3]
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path / "ckpt"), str(step)], cwd=repo)
    assert killed.returncode == -9
    resumed, weights = _loaded(manager)
    assert resumed["step"] == 2
    for name, tensor in first[0].state_dict().items():
        assert torch.equal(weights[name], tensor)
    assert len(_everything(tmp_path / "ckpt")) > 2  # the killed save's partial file is there
    manager.save(6, *_trained(6))
    assert _everything(tmp_path / "ckpt") == ["step-000006", "step-000006/state.pt"]


def test_the_old_checkpoint_is_removed_only_after_the_new_one_is_complete(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path / "ckpt", "digest")
    manager.save(2, *_trained(2))
    seen, rmtree = [], training.shutil.rmtree

    def watched(path, *args, **kwargs):
        seen.append((Path(path).name, (tmp_path / "ckpt" / "step-000004" / "state.pt").is_file()))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(training.shutil, "rmtree", watched)
    manager.save(4, *_trained(4))
    assert seen == [("step-000002", True)]


def test_what_a_killed_save_left_is_removed_by_the_next_and_a_same_step_save_replaces_whole(tmp_path):
    """A process killed while writing leaves a partial file (in a new step folder, or beside a
    complete checkpoint of the same step) or, from earlier versions, a partial folder: none is
    a checkpoint, and the next save removes them before it writes."""
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, "digest")
    manager.save(2, *_trained(2))
    (root / "step-000004").mkdir()
    (root / "step-000004" / f".state.pt.{os.getpid() + 1}.partial").write_bytes(b"half")
    (root / "step-000002" / ".state.pt.7.partial").write_bytes(b"half")
    (root / ".step-000003.abc.partial").mkdir()
    assert [p.name for p in manager.checkpoints()] == ["step-000002"]
    assert _loaded(manager)[0]["step"] == 2
    manager.save(2, *_trained(5))  # the same step again: the file is replaced whole
    assert _everything(root) == ["step-000002", "step-000002/state.pt"]
    weights = _loaded(manager)[1]
    for name, tensor in _trained(5)[0].state_dict().items():
        assert torch.equal(weights[name], tensor)


def test_train_loop_checkpoints_by_the_clock_and_keeps_the_newest(tmp_path, monkeypatch):
    """train_loop with ``checkpoint_every_minutes``: a fake clock that moves 40 s at each
    reading saves after steps 2, 4 and 6 of 8; one checkpoint, the newest, is left."""
    clock = FakeClock()

    def reading() -> float:
        clock.advance(40)
        return clock()

    monkeypatch.setattr(training, "wall_clock", reading)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def step_fn(indices, parallel):
        total = 0.0
        for mb in parallel.accumulate(list(micro_batches(indices, 2))):
            loss = parallel(lambda m, a, b: (m(a) - b).pow(2).sum(), x[mb], y[mb]) / len(indices)
            loss.backward()
            total += loss.item()
        return {"loss": total, "tokens": float(len(indices))}

    cfg = EpochTrainerConfig(batch_size=2, micro_batch_size=2, checkpoint_every_minutes=1, bf16=False)
    out, metrics = train_loop(
        desc="sft",
        model=model,
        n_rows=16,
        optim=cfg,
        step_fn=step_fn,
        device=torch.device("cpu"),
        out_dir=tmp_path,
        inputs=[],
        rebuild=lambda: torch.nn.Linear(4, 1),
    )
    assert metrics["steps"] == 8
    assert _everything(tmp_path / "checkpoints") == ["step-000006", "step-000006/state.pt"]
