import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlhf_core.config.presets import load_config
from rlhf_core.evaluation.judging import Judgement
from rlhf_core.run.cli import main

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.heavy
def test_data_command_writes_the_output_contract(tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["data", "--preset", "smoke", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"]["sft/train"] == 32
    for rel in (
        "sft/train",
        "sft/validation",
        "sft/test",
        "preference/train",
        "preference/validation",
        "preference/validation_cnndm",
        "tokenizer/tokenizer_config.json",
        "stats.json",
        "token_lengths.png",
    ):
        assert (out / rel).exists(), rel
    stats = json.loads((out / "stats.json").read_text())
    assert stats["padded_lengths"] == printed["padded_lengths"]
    # existing output is not replaced without --overwrite
    assert main(["data", "--preset", "smoke", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_bad_override_exits_2_naming_the_key(tmp_path, capsys):
    assert main(["data", "--preset", "smoke", "ppo.kl_cof=0.1", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "ppo.kl_cof: unknown key" in err
    assert not (tmp_path / "x").exists()


def test_run_reuses_finished_stages(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    until = ["--until", "base_model"]
    with caplog.at_level("INFO", logger="rlhf_core.common.memory"):
        assert main(["stages", "--preset", "smoke", *until, "--out", str(out)]) == 0
    first = json.loads(capsys.readouterr().out)
    for stage in ("data", "base_model"):  # each stage run gives its freed memory back before the next
        assert f"after stage {stage}: freed memory given back to the system" in caplog.text
    assert first["data"]["reused"] is False and first["base_model"]["reused"] is False
    assert (out / "base_model" / "model.safetensors").is_file() and (out / "data" / "stats.json").is_file()
    stamp = (out / "data" / "stats.json").stat().st_mtime_ns
    assert main(["stages", "--preset", "smoke", *until, "--out", str(out)]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second == {"data": {"reused": True}, "base_model": {"reused": True}}
    assert (out / "data" / "stats.json").stat().st_mtime_ns == stamp
    marker = json.loads((out / "data" / "stage.json").read_text())
    assert marker["parts"]["config"]["data"]["sft_splits"]["train"]["max_rows"] != 8
    assert marker["parts"]["code_modules"]["rlhf_core/data/prepare.py"] and marker["parts"]["stage"] == "data"
    # a changed data setting re-runs data but keeps the base model; the plan says why
    from rlhf_core.run.cli import plan_stages

    before = marker["parts"]["config"]["data"]["sft_splits"]["train"]["max_rows"]
    plan = plan_stages(load_config("smoke", ["data.sft_splits.train.max_rows=8"]), out, "base_model")
    assert [(p.name, p.cached, p.reason) for p in plan] == [
        ("data", False, f"its settings changed: data.sft_splits.train.max_rows {before!r} -> 8"),
        ("base_model", True, f"finished in {out / 'base_model'}"),
    ]
    assert main(["stages", "--preset", "smoke", *until, "data.sft_splits.train.max_rows=8", "--out", str(out)]) == 0
    third = json.loads(capsys.readouterr().out)
    assert third["data"]["reused"] is False and third["base_model"]["reused"] is True
    assert json.loads((out / "data" / "stats.json").read_text())["splits"]["sft/train"]["rows"] == 8
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["sft_splits"]["train"]["max_rows"] == 8


def _writable_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    for path in dest.iterdir():
        path.chmod(0o644)
    return dest


def _edit_first_row(path: Path, field: str, value: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    row = json.loads(lines[0])
    row[field] = value
    lines[0] = json.dumps(row) + "\n"
    path.write_text("".join(lines))


@pytest.mark.heavy
def test_an_edited_data_row_reruns_data_and_what_follows(tmp_path, tldr_dir, monkeypatch, capsys):
    """The data stage's key covers the data files' contents, not only the data settings:
    ``RLHF_TLDR_DIR`` pointed at edited data re-runs ``data`` and SFT, not the base model."""
    data = _writable_copy(tldr_dir, tmp_path / "tldr")
    monkeypatch.setenv("RLHF_TLDR_DIR", str(data))
    out = tmp_path / "run"
    argv = ["stages", "--preset", "smoke", "--until", "sft", "sft.max_steps=1", "--out", str(out)]
    assert main(argv) == 0
    assert not any(v["reused"] for v in json.loads(capsys.readouterr().out).values())
    assert main(argv) == 0
    assert all(v["reused"] for v in json.loads(capsys.readouterr().out).values())
    # the smoke preset trains SFT on the first 32 rows of sft_validation.jsonl
    _edit_first_row(data / "sft_validation.jsonl", "summary", "an edited reference summary")
    from rlhf_core.run.cli import plan_stages

    reasons = {p.name: p.reason for p in plan_stages(load_config("smoke", ["sft.max_steps=1"]), out, "sft")}
    assert reasons["data"] == "what it reads changed: data" and reasons["sft"] == "its input data changed"
    assert main(argv) == 0
    third = json.loads(capsys.readouterr().out)
    assert {s: v["reused"] for s, v in third.items()} == {"data": False, "base_model": True, "sft": False}
    import datasets

    train = datasets.load_from_disk(str(out / "data" / "sft" / "train"))
    assert train[0]["summary"] == "an edited reference summary"


def test_data_keys_follow_the_files_contents_not_their_place(tmp_path, tldr_dir, monkeypatch):
    from rlhf_core.run.pipeline import stage_keys

    cfg = load_config("smoke")
    monkeypatch.setenv("RLHF_TLDR_DIR", str(tldr_dir))
    original = stage_keys(cfg)
    monkeypatch.setenv("RLHF_TLDR_DIR", str(_writable_copy(tldr_dir, tmp_path / "elsewhere")))
    assert stage_keys(cfg) == original  # the same bytes in another folder: every stage stays cached
    # a file no split reads does not count; one byte in a file a split reads does
    (tmp_path / "elsewhere" / "README.md").write_text("changed")
    assert stage_keys(cfg) == original
    _edit_first_row(tmp_path / "elsewhere" / "preference_validation_cnndm.jsonl", "batch", "batch0_cnndm ")
    edited = stage_keys(cfg)
    assert {s for s in original if original[s] != edited[s]} == set(original) - {"base_model"}


def test_model_source_keys_follow_the_model_files(tmp_path, monkeypatch):
    """A local model directory is keyed on its files' contents: a changed file re-runs
    ``base_model`` (and, through its tokenizer, ``data``), or as the offline judge the evaluation."""
    from rlhf_core.models.base import import_base_model
    from rlhf_core.run.pipeline import stage_keys

    cfg = load_config("smoke")
    import_base_model(cfg.model, tmp_path / "base")
    local = load_config("smoke", [f"model.base={tmp_path / 'base'}", "model.random_init=null", "model.tokenizer=null"])
    judged = load_config("smoke", [f"eval.judge_model={tmp_path / 'base'}"])  # an offline judge from a folder
    before, judged_before = stage_keys(local, "base_model"), stage_keys(judged)
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 2
    (tmp_path / "base" / "config.json").write_text(json.dumps(config))
    after, judged_after = stage_keys(local, "base_model"), stage_keys(judged)
    assert before["base_model"] != after["base_model"] and before["data"] != after["data"]
    assert {s for s in judged_before if judged_before[s] != judged_after[s]} == {"evaluation"}


SHORT = [
    "sft.max_steps=2",
    "reward.max_steps=2",
    "dpo.max_steps=2",
    "ppo.total_episodes=8",
    "ppo.batch_size=4",
    "ppo.eval_every=1",
]


def test_a_run_that_stops_at_one_method_skips_the_other():
    """``--until``: every stage up to it, but the PPO branch (reward model and PPO) and the DPO
    branch leave each other out unless the stage reads both (the evaluation)."""
    from rlhf_core.run.pipeline import STAGES, stages_until

    assert stages_until("dpo") == ["data", "base_model", "sft", "dpo"]
    assert stages_until("dpo_eval") == ["data", "base_model", "sft", "dpo", "dpo_eval"]
    assert stages_until("ppo") == ["data", "base_model", "sft", "reward", "reward_norm", "reward_eval", "ppo"]
    assert stages_until("base_model") == ["data", "base_model"]
    assert stages_until("evaluation") == stages_until(None) == list(STAGES)
    assert STAGES["evaluation"].inputs[-2:] == ("dpo", "dpo_eval")
    with pytest.raises(KeyError, match="no stage 'rl'"):
        stages_until("rl")


@pytest.mark.slow
def test_full_smoke_pipeline_and_downstream_reruns(tmp_path, capsys):
    """Every stage on the smoke preset; then a PPO-only change re-runs PPO alone."""
    from rlhf_core.run.pipeline import STAGES

    out = tmp_path / "run"
    assert main(["stages", "--preset", "smoke", *SHORT, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert list(summary) == list(STAGES)  # every stage, in run order
    assert 0 <= summary["sft"]["metrics"]["eval/rougeL"] <= 1
    assert abs(summary["reward_norm"]["metrics"]["normalization/mean_after"]) < 1e-3
    assert 0 <= summary["reward_eval"]["metrics"]["eval/accuracy"] <= 1
    assert "objective/kl" in summary["ppo"]["metrics"]
    ev = summary["evaluation"]["metrics"]
    assert 0 <= summary["dpo_eval"]["metrics"]["eval/accuracy"] <= 1
    for policy in ("base", "sft", "ppo", "dpo"):
        assert 0 <= ev[f"eval/{policy}/win_rate"] <= 1 and ev[f"eval/{policy}/win_rate_n_valid"] == 8
        assert (
            ev[f"eval/{policy}/win_rate_ci_low"]
            <= ev[f"eval/{policy}/win_rate"]
            <= ev[f"eval/{policy}/win_rate_ci_high"]
        )
    lines = (out / "evaluation" / "judgements.jsonl").read_text().splitlines()
    judged = [Judgement.from_dict(json.loads(line)) for line in lines]
    assert all(j.swapped is not None for j in judged)  # the offline judge: both orders
    assert sum(j.policy == "human-chosen" for j in judged) == 8 == ev["eval/judge/human_n"]
    assert len(judged) == 40 and {j.policy for j in judged} == {"base", "sft", "ppo", "dpo", "human-chosen"}
    assert sum(j.outcome for j in judged if j.policy == "ppo") / 8 == ev["eval/ppo/win_rate"]
    html = (out / "evaluation" / "report.html").read_text()
    assert "data:image/png;base64," in html and "token-shift" in html and "Training curves" in html
    for stage in summary:
        assert json.loads((out / stage / "stage.json").read_text())["status"] == "done"
    for rel in (
        "sft/model/model.safetensors",
        "reward_norm/model/model.safetensors",
        "reward_eval/calibration.png",
        "ppo/model/model.safetensors",
        "ppo/value_model/model.safetensors",
        "dpo/model/model.safetensors",
        "dpo_eval/calibration.png",
        "ppo/metrics.jsonl",
        "evaluation/report.md",
        "evaluation/length_control.png",
        "evaluation/summaries.jsonl",
    ):
        assert (out / rel).is_file(), rel
    # with a checkpoint after its first update, which goes once the stage is done
    argv = ["stages", "--preset", "smoke", *SHORT, "ppo.kl_coef=0.1", "ppo.checkpoint_every=1", "--out", str(out)]
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert [s for s, v in again.items() if not v["reused"]] == ["ppo", "evaluation"]
    assert not (out / "ppo" / "checkpoints").exists()
    # the judge is not asked again about what it has already judged: base and SFT summaries are the same
    lines = (out / "evaluation" / "judgements.jsonl").read_text().splitlines()
    rejudged = [Judgement.from_dict(json.loads(line)) for line in lines]
    for j in rejudged:
        if j.policy in ("base", "sft", "dpo", "human-chosen"):
            assert j.cached and j.attempts == 0 and j.swapped.cached and j.swapped.attempts == 0
    new = sum((not j.cached) + (not j.swapped.cached) for j in rejudged)
    assert len((out / "judge_cache.jsonl").read_text().splitlines()) == 2 * 40 + new


def test_console_script_prints_gpu_preset():
    """The installed `rlhf` entry point loads and validates a GPU preset without a GPU."""
    exe = Path(sys.executable).with_name("rlhf")
    result = subprocess.run(
        [str(exe), "config", "--preset", "llama-3.2-1b-h200", "ppo.kl_coef=0.07"],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    assert cfg["ppo"]["kl_coef"] == 0.07 and cfg["ppo"]["learning_rate"] == 1.5e-6


@pytest.mark.parametrize(
    "override, changed",
    [
        ("reward.eval_max_samples=3", {"reward_eval", "dpo_eval", "evaluation"}),
        ("reward.normalization_max_samples=3", {"reward_norm", "reward_eval", "ppo", "evaluation"}),
        ("reward.learning_rate=1e-4", {"reward", "reward_norm", "reward_eval", "ppo", "evaluation"}),
        ("eval.title_copy_threshold=0.5", {"evaluation"}),
        ("ppo.temperature=0.9", {"ppo", "evaluation"}),
        ("ppo.non_eos_penalty=-2", {"ppo", "evaluation"}),
        ("sft.max_steps=3", {"sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval", "evaluation"}),
        ("dpo.beta=0.1", {"dpo", "dpo_eval", "evaluation"}),
    ],
)
def test_a_setting_changes_the_keys_of_its_stage_and_those_downstream_only(override, changed):
    from rlhf_core.run.pipeline import stage_keys

    before, after = stage_keys(load_config("smoke")), stage_keys(load_config("smoke", [override]))
    assert {s for s in before if before[s] != after[s]} == changed


def test_stage_keys_follow_the_code_version(monkeypatch):
    """``rlhf run`` reuses a finished stage only with the same code: the key covers the code
    the stage runs (:func:`rlhf_core.run.pipeline.code_version`)."""
    from rlhf_core.run import pipeline

    cfg = load_config("smoke")
    before = pipeline.stage_keys(cfg)
    from rlhf_core.common.stage_code import StageCode

    monkeypatch.setattr(pipeline, "code_version", lambda name: StageCode("0" * 16, "0" * 16, {}))
    after = pipeline.stage_keys(cfg)
    assert all(before[s] != after[s] for s in before)
    assert list(pipeline.stage_keys(cfg, "sft")) == ["data", "base_model", "sft"]
    with pytest.raises(KeyError, match="no stage 'rm'"):
        pipeline.stage_keys(cfg, "rm")


def test_the_code_version_covers_subpackages(tmp_path):
    """A change in ``rlhf_core/evaluation/judging/`` (a subpackage the evaluation imports) changes the
    evaluation's code version, as one in a top-level module it imports does."""
    from rlhf_core.common.stage_code import stage_code_digest
    from rlhf_core.run import pipeline

    def digest(name: str, edit: str | None = None) -> str:
        root = tmp_path / name / "rlhf_core"
        shutil.copytree(pipeline.SOURCE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
        if edit is not None:
            (root / edit).write_text((root / edit).read_text() + "\n# changed\n")
        return stage_code_digest(root, pipeline.__name__, "evaluation")

    unchanged = digest("copy")
    assert pipeline.code_version("evaluation").digest == unchanged
    assert len({unchanged, digest("judging", "evaluation/judging/prompt.py"), digest("ppo", "ppo/algorithm.py")}) == 3


def test_the_reward_command_answers_to_its_old_name_rm(tmp_path, monkeypatch):
    from rlhf_core.run import cli

    seen = []
    commands = {
        name: cli.Command(
            lambda cfg, args, name=name: seen.append((name, args.command)) or 0,
            c.help,
            out=c.out,
            until=c.until,
            aliases=c.aliases,
        )
        for name, c in cli.COMMANDS.items()
    }
    for typed in ("reward", "rm"):
        assert cli.main([typed, "--preset", "smoke", "--out", str(tmp_path)], commands=commands) == 0
    assert seen == [("reward", "reward"), ("reward", "reward")]


def test_a_finished_stage_changed_in_place_runs_again(tmp_path, capsys, caplog):
    """``stage.json`` records every output file's SHA-256: a same-size change in the base
    model's weights is found on the next run, which names the file and rebuilds the stage."""
    out = tmp_path / "run"
    argv = ["stages", "--preset", "smoke", "--until", "base_model", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    weights = out / "base_model" / "model.safetensors"
    original = weights.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2 : len(damaged) // 2 + 4096] = bytes(4096)
    weights.write_bytes(bytes(damaged))
    with caplog.at_level("WARNING", logger="rlhf_core"):
        assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {stage: v["reused"] for stage, v in summary.items()} == {"data": True, "base_model": False}
    assert "model.safetensors: SHA-256 differs from its manifest (changed in place)" in caplog.text
    assert weights.read_bytes() == original  # rebuilt: the random init is seeded


def test_exclusive_lock_names_its_holder_and_is_freed_when_the_holder_is_killed(tmp_path):
    import signal
    import socket

    from rlhf_core.common.io import LockHeldError, exclusive_lock

    lock = tmp_path / "stage.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from rlhf_core.common.io import exclusive_lock\n"
            f"with exclusive_lock({str(lock)!r}, 'a stage'):\n"
            "    print('held', flush=True); time.sleep(600)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeldError, match=rf"a stage is in use by pid {holder.pid} on {socket.gethostname()}"):
            with exclusive_lock(lock, "a stage", wait=False):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with exclusive_lock(lock, "a stage", wait=False):  # the kernel released it with the process
        assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_help_loads_no_framework_and_no_preset_means_the_deployments():
    """``rlhf --help`` and ``rlhf run --help`` import neither torch, transformers, datasets nor
    Prefect (they took 8 and 12 s when they did); a command without ``--preset`` uses the
    deployment's preset, not the paper's 1B setting."""
    code = (
        "import sys, contextlib, io\n"
        "from flows.cli import main\n"
        "for argv in (['--help'], ['run', '--help'], ['sft', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "heavy = sorted({'torch', 'transformers', 'datasets', 'prefect', 'mlflow'} & set(sys.modules))\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]
    deployment = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())
    [preset] = {d["parameters"]["preset"] for d in deployment["deployments"] if d["name"] == "full-pipeline"}
    exe = Path(sys.executable).with_name("rlhf")
    shown = subprocess.run([str(exe), "config"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and yaml.safe_load(shown.stdout)["name"] == load_config(preset).name == preset


def _backdate(root: Path, age_ns: int = 3600 * 10**9) -> None:
    then = time.time_ns() - age_ns
    for path in root.rglob("*"):
        if path.is_file() and path.name != "stage.json":
            os.utime(path, ns=(then, then))


def test_a_copied_stage_is_read_once_then_reused_without_reading(tmp_path, capsys, monkeypatch):
    """A reused stage's files are read only when their size or time differs from its
    ``stage.json`` (here: every time changed, as by a copy); found unchanged, their times are
    recorded, and the next run reads no file. A same-size change whose time is set back is
    missed by that check and found by ``rlhf verify``, which reads every file."""
    from rlhf_core.common import io

    out = tmp_path / "run"
    argv = ["stages", "--preset", "smoke", "--until", "data", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    listed = json.loads((out / "data" / "stage.json").read_text())["manifest"]["files"]
    _backdate(out / "data")
    read, real = [], io.file_sha256
    monkeypatch.setattr(io, "file_sha256", lambda path: read.append(path) or real(path))
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {"data": {"reused": True}}
    assert len(read) == len(listed)
    marker = json.loads((out / "data" / "stage.json").read_text())
    assert all(
        meta["mtime_ns"] == (out / "data" / rel).stat().st_mtime_ns for rel, meta in marker["manifest"]["files"].items()
    )

    def no_reading(path):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(io, "file_sha256", no_reading)
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {"data": {"reused": True}}

    stats = out / "data" / "stats.json"
    before = stats.stat()
    stats.write_text(stats.read_text().replace('"rows"', '"ROWS"'))
    os.utime(stats, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert main(argv) == 0  # the trade-off: size and time unchanged, the file is not read
    assert json.loads(capsys.readouterr().out) == {"data": {"reused": True}}
    monkeypatch.setattr(io, "file_sha256", real)
    assert main(["verify", str(out)]) == 1
    captured = capsys.readouterr()
    assert f"{out / 'data'}: stats.json: SHA-256 differs from its manifest (changed in place)" in captured.out
    assert "rlhf verify: 1 of 1 outputs differ from their manifests" in captured.err


@pytest.mark.heavy
def test_verify_exit_codes_through_the_console_script(tmp_path):
    """``rlhf verify DIR``: 0 when every file of every finished stage below DIR matches its
    manifest, 1 naming each file that does not, 2 when there is nothing to check."""
    from rlhf_core.common.io import tree_manifest, write_json_atomic

    run = tmp_path / "run"
    for stage in ("sft", "ppo"):
        (run / stage / "model").mkdir(parents=True)
        (run / stage / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        (run / stage / "metrics.jsonl").write_text("{}\n")
        manifest = tree_manifest(run / stage, exclude=("checkpoints", "stage.json"))
        write_json_atomic(run / stage / "stage.json", {"key": "k", "status": "done", "manifest": manifest})
    (run / "dpo").mkdir()
    exe = Path(sys.executable).with_name("rlhf")

    def verify(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(exe), "verify", str(path)], capture_output=True, text=True, timeout=120)

    ok = verify(run)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [
        f"{run / 'ppo'}: 2 files match",
        f"{run / 'sft'}: 2 files match",
        "rlhf verify: all 2 outputs match their manifests (4 files read)",
    ]
    weights = run / "ppo" / "model" / "model.safetensors"
    weights.write_bytes(bytes(256) + weights.read_bytes()[256:])
    (run / "sft" / "metrics.jsonl").unlink()
    write_json_atomic(run / "dpo" / "stage.json", {"key": "k", "status": "running"})
    bad = verify(run)
    assert bad.returncode == 1
    assert bad.stdout.splitlines() == [
        f"{run / 'dpo'}: stage.json: no manifest (status running: not finished)",
        f"{run / 'ppo'}: model/model.safetensors: SHA-256 differs from its manifest (changed in place)",
        f"{run / 'sft'}: metrics.jsonl: missing",
    ]
    assert "rlhf verify: 3 of 3 outputs differ from their manifests" in bad.stderr
    assert verify(run / "ppo").returncode == 1 and verify(run / "sft" / "model").returncode == 2
    nothing = verify(tmp_path / "nowhere")
    assert (
        nothing.returncode == 2 and f"rlhf verify: error: {tmp_path / 'nowhere'}: no such directory" in nothing.stderr
    )


def test_config_and_verify_import_no_framework(tmp_path):
    """``import rlhf_core.run.cli``, ``rlhf config`` and ``rlhf verify`` (output to a pipe, no
    terminal) load neither torch, transformers, datasets, matplotlib, Prefect nor MLflow; the
    command tells ``datasets`` not to look for TensorFlow or JAX."""
    code = (
        "import sys, os, contextlib, io\n"
        "import rlhf_core.run.cli\n"
        "print(sorted({'torch', 'transformers', 'datasets', 'matplotlib', 'prefect', 'mlflow'} & set(sys.modules)))\n"
        "from rlhf_core.run.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['config', '--preset', 'smoke']) == 0\n"
        f"    assert main(['verify', {str(tmp_path)!r}]) == 2\n"
        "print(sorted({'torch', 'transformers', 'datasets', 'matplotlib', 'prefect', 'mlflow'} & set(sys.modules)))\n"
        "print(os.environ['USE_JAX'], os.environ['USE_TF'], os.environ['HF_DATASETS_DISABLE_PROGRESS_BARS'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("USE_JAX", "USE_TF", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["[]", "[]", "0 0 1"]


#: The smoke preset's data cut to a few rows: a run directory whose stages finish quickly.
FEW_ROWS = [
    "data.sft_splits.train.max_rows=8",
    "data.sft_splits.validation.max_rows=4",
    "data.sft_splits.test.max_rows=4",
    "data.preference_splits.train.max_rows=8",
    "data.preference_splits.validation.max_rows=8",
    "data.preference_splits.validation_cnndm.max_rows=4",
]


def test_a_stage_command_that_only_reuses_its_stages_loads_no_framework(tmp_path, capsys):
    """A stage command run again on its finished run directory reuses every stage, deciding so
    from the stage keys alone (the data files' and the model source's fingerprints,
    :mod:`rlhf_core.models.sources`): it loads neither torch, transformers nor datasets, which took
    seconds to load before any stage was looked at. (The keys of ``sft``, ``reward`` and ``dpo``
    read nothing beyond those of ``data`` and ``base_model``.) ``rlhf plan`` on that directory
    names the two finished stages cached and every other to run, with the keys ``rlhf stages``
    uses, loading none of them either."""
    from rlhf_core.run.pipeline import STAGES, stage_keys

    run = tmp_path / "run"
    argv = ["stages", "--preset", "smoke", *FEW_ROWS, "--until", "base_model", "--out", str(run)]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert {stage: v["reused"] for stage, v in first.items()} == {"data": False, "base_model": False}
    plan = ["plan", "--preset", "smoke", *FEW_ROWS, "--out", str(run)]
    code = (
        "import contextlib, io, json, sys\n"
        "from rlhf_core.run.cli import main\n"
        "printed, planned = io.StringIO(), io.StringIO()\n"
        "with contextlib.redirect_stdout(printed):\n"
        f"    code = main({argv!r})\n"
        "with contextlib.redirect_stdout(planned):\n"
        f"    plan_code = main({plan!r})\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'datasets'})\n"
        "print(json.dumps({'code': code, 'summary': json.loads(printed.getvalue()), 'loaded': loaded,\n"
        "                  'plan_code': plan_code, 'plan': planned.getvalue().splitlines()}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    again = json.loads(result.stdout)
    assert again["code"] == 0
    assert again["summary"] == {"data": {"reused": True}, "base_model": {"reused": True}}
    assert again["loaded"] == []
    keys = stage_keys(load_config("smoke", FEW_ROWS))
    assert again["plan_code"] == 0 and len(again["plan"]) == len(STAGES) + 1
    for line, (name, key) in zip(again["plan"], keys.items()):
        assert line.split()[:3] == [name, key, "cached" if name in ("data", "base_model") else "runs"], line
    assert again["plan"][-1] == f"rlhf plan: preset smoke: {len(STAGES) - 2} of {len(STAGES)} stages run, 2 from cache"
    # a finished stage's file changed since: it runs again, and the plan says why
    marker = json.loads((run / "base_model" / "stage.json").read_text())
    changed = next(iter(marker["manifest"]["files"]))
    (run / "base_model" / changed).write_bytes(b"changed")
    assert main(plan) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("base_model "))
    assert line.split()[2] == "runs" and f"its finished output is damaged: {changed}" in line, line


def test_a_users_file_in_a_stage_folder_survives_every_stage_command(tmp_path, capsys):
    """A folder named like a stage but holding no ``stage.json`` may be the user's: every stage
    command refuses it, with ``--overwrite`` too, in one line naming it, and leaves its files as
    they were, whether it sits in a directory new to the commands or in one of their run
    directories."""
    from rlhf_core.run.cli import RUN_MARKER, claim_run_directory

    fresh, run = tmp_path / "mine", tmp_path / "run"
    claim_run_directory(run, "stages")
    prefs = b'{"chosen": "mine", "rejected": "theirs"}\n'
    for root in (fresh, run):
        (root / "data").mkdir(parents=True)
        (root / "data" / "my_prefs.jsonl").write_bytes(prefs)
    refused = {
        fresh: f"{fresh} is not a run directory of the rlhf stage commands (it has no {RUN_MARKER}) "
        "and holds what they did not write: data/;",
        run: f"{run / 'data'} holds my_prefs.jsonl and no stage.json: not a stage folder the pipeline wrote;",
    }
    for root, argv in [
        (fresh, ["stages", "--until", "data"]),
        (fresh, ["stages", "--until", "data", "--overwrite"]),
        (run, ["stages", "--until", "data"]),
        (run, ["stages", "--until", "data", "--overwrite"]),
        (run, ["sft", "--overwrite"]),
    ]:
        assert main([*argv, "--preset", "smoke", "--out", str(root)]) == 2
        err = capsys.readouterr().err
        assert f"rlhf {argv[0]}: error: {refused[root]}" in err, err
        assert "give --out a new or empty directory, or move those files away" in err
        assert os.listdir(root / "data") == ["my_prefs.jsonl"]
        assert (root / "data" / "my_prefs.jsonl").read_bytes() == prefs
        assert not (root / "config.yaml").exists() and not (root / "summary.json").exists()
    assert os.listdir(fresh) == ["data"]  # nothing written beside it: no marker, no lock


def test_a_stage_command_refuses_a_directory_it_did_not_write(tmp_path, capsys):
    """A directory holding files of the user's at its top is not a run directory: nothing is
    written there, its ``config.yaml`` least of all. That name counts as a stage command's only
    beside a stage folder holding a ``stage.json``; the refusal names what is not theirs."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("mine: true\n")
    assert main(["sft", "--preset", "smoke", "--out", str(project)]) == 2
    err = capsys.readouterr().err
    assert f"rlhf sft: error: {project} is not a run directory of the rlhf stage commands" in err
    assert "holds what they did not write: config.yaml;" in err
    (project / "data").mkdir()
    (project / "data" / "stage.json").write_text("{}")
    (project / "notes.md").write_text("notes\n")
    assert main(["stages", "--preset", "smoke", "--until", "data", "--overwrite", "--out", str(project)]) == 2
    assert "holds what they did not write: notes.md;" in capsys.readouterr().err
    assert sorted(os.listdir(project)) == ["config.yaml", "data", "notes.md"]
    assert (project / "config.yaml").read_text() == "mine: true\n" and os.listdir(project / "data") == ["stage.json"]
    (tmp_path / "file").write_text("mine\n")
    assert main(["stages", "--preset", "smoke", "--out", str(tmp_path / "file")]) == 2
    assert f"rlhf stages: error: {tmp_path / 'file'} is not a directory;" in capsys.readouterr().err


def test_a_run_directory_is_marked_and_one_from_before_the_marker_adopted(tmp_path, capsys):
    """A stage command marks the run directory it creates; run again, it reuses its stages. A run
    directory written before the marker existed (nothing in it but what the commands write) is
    adopted, marked, and its stages reused."""
    from rlhf_core.run.cli import RUN_MARKER

    out = tmp_path / "run"
    argv = ["stages", "--preset", "smoke", *FEW_ROWS, "--until", "data", "--out", str(out)]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["data"]["reused"] is False
    marker = json.loads((out / RUN_MARKER).read_text())
    assert marker["written_by"] == "rlhf stages" and marker["adopted"] is False
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {"data": {"reused": True}}
    (out / RUN_MARKER).unlink()
    assert sorted(os.listdir(out)) == [".rlhf-stages.lock", "config.yaml", "data", "summary.json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {"data": {"reused": True}}
    assert json.loads((out / RUN_MARKER).read_text())["adopted"] is True


def test_an_empty_stage_folder_left_behind_is_reused(tmp_path, capsys):
    """An empty stage folder (made, then the command stopped before its ``stage.json``) holds
    nothing of anyone's: the stage runs into it."""
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    assert main(["stages", "--preset", "smoke", *FEW_ROWS, "--until", "data", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["reused"] is False
    assert json.loads((out / "data" / "stage.json").read_text())["status"] == "done"
    assert (out / "data" / "stats.json").is_file()


@pytest.mark.heavy
def test_data_and_model_overwrite_replace_only_their_own_output(tmp_path, capsys):
    """``rlhf data|model --overwrite`` replaces a directory only when it is empty or an earlier
    output of the same command; one holding anything else is refused, naming it, untouched."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my_prefs.jsonl").write_text('{"chosen": "mine"}\n')
    for command in ("data", "model"):
        assert main([command, "--preset", "smoke", "--overwrite", "--out", str(mine)]) == 2
        err = capsys.readouterr().err
        assert f"rlhf {command}: error: {mine} is not an output of rlhf {command} (it holds my_prefs.jsonl" in err
        assert "so --overwrite does not replace it" in err
    assert os.listdir(mine) == ["my_prefs.jsonl"] and (mine / "my_prefs.jsonl").read_text() == '{"chosen": "mine"}\n'

    data = tmp_path / "data"
    assert main(["data", "--preset", "smoke", *FEW_ROWS, "--out", str(data)]) == 0
    argv = [
        "data",
        "--preset",
        "smoke",
        *FEW_ROWS,
        "data.sft_splits.train.max_rows=6",
        "--overwrite",
        "--out",
        str(data),
    ]
    assert main(argv) == 0
    assert json.loads((data / "stats.json").read_text())["splits"]["sft/train"]["rows"] == 6
    (data / "notes.md").write_text("notes\n")
    assert main(argv) == 2
    assert f"{data} is not an output of rlhf data (it holds notes.md" in capsys.readouterr().err
    assert (data / "notes.md").is_file()

    model = tmp_path / "model"
    model.mkdir()  # empty: taken
    for _ in range(2):  # then replaced, as its own output
        assert main(["model", "--preset", "smoke", "--overwrite", "--out", str(model)]) == 0
        assert (model / "import.json").is_file()
