"""A stage's key covers the code it runs, not the whole package: ``rlhf plan``'s keys
(:func:`rlhf_core.run.cli.plan_stages`) on copies of ``rlhf_core`` with one file edited."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlhf_core.common.stage_code import import_closure, table_entry
from rlhf_core.config.presets import load_config
from rlhf_core.run import pipeline
from rlhf_core.run.cli import plan_stages

#: The package's own sources, copied for each variant (``pipeline.SOURCE_ROOT`` is then patched).
PACKAGE = pipeline.SOURCE_ROOT
#: The stages before the evaluation: no edit to the report or the evaluation re-runs them.
TRAINING = ("data", "base_model", "sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval")


@pytest.fixture(scope="module")
def cfg():
    return load_config("smoke")


def _copy(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name / "rlhf_core"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _only(root: Path, relative: str) -> Path:
    path = root / relative
    assert path.is_file(), path
    return path


def _edit_docstring(path: Path) -> None:
    """Add a sentence to the module's docstring: its code stays the same."""
    text = path.read_text()
    assert text.startswith('"""'), path
    path.write_text('"""An edited sentence. ' + text[3:])


def _keys(monkeypatch, cfg, root: Path) -> dict[str, str]:
    monkeypatch.setattr(pipeline, "SOURCE_ROOT", root)
    return {p.name: p.key for p in plan_stages(cfg, None)}


def _changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    assert before.keys() == after.keys()
    return {s for s in before if before[s] != after[s]}


def test_the_keys_of_a_copy_equal_those_of_the_package(tmp_path, monkeypatch, cfg):
    """The digest reads the sources, not where they are: an unedited copy gives the same keys."""
    original = {p.name: p.key for p in plan_stages(cfg, None)}
    assert _keys(monkeypatch, cfg, _copy(tmp_path, "copy")) == original
    assert len(set(original.values())) == len(original)


def test_a_docstring_edit_in_the_report_re_runs_only_what_imports_it(tmp_path, monkeypatch, cfg):
    before = _keys(monkeypatch, cfg, _copy(tmp_path, "before"))
    edited = _copy(tmp_path, "edited")
    _edit_docstring(_only(edited, "views/page.py"))
    changed = _changed(before, _keys(monkeypatch, cfg, edited))
    assert "evaluation" in changed
    assert not changed & set(TRAINING), changed


def test_a_docstring_edit_in_the_evaluations_own_modules_re_runs_only_the_evaluation(tmp_path, monkeypatch, cfg):
    """The modules the evaluation stage's entry imports that no training stage reaches."""
    before_root = _copy(tmp_path, "before")
    before = _keys(monkeypatch, cfg, before_root)
    table = pipeline.__name__
    _, own = table_entry(before_root, table, "evaluation")
    for stage in TRAINING:
        own -= table_entry(before_root, table, stage)[1]
    assert own
    for module in sorted(own):
        edited = _copy(tmp_path, module)
        _edit_docstring(edited.parent.joinpath(*module.split(".")).with_suffix(".py"))
        changed = _changed(before, _keys(monkeypatch, cfg, edited))
        assert "evaluation" in changed and not changed & set(TRAINING), (module, changed)


def test_an_edit_in_ppo_re_runs_ppo_and_what_follows_not_sft(tmp_path, monkeypatch, cfg):
    before = _keys(monkeypatch, cfg, _copy(tmp_path, "before"))
    edited = _copy(tmp_path, "edited")
    ppo = _only(edited, "ppo/algorithm.py")
    ppo.write_text(ppo.read_text() + "\n\ndef _unused():\n    return 0\n")
    changed = _changed(before, _keys(monkeypatch, cfg, edited))
    assert {"ppo", "evaluation"} <= changed
    assert not changed & {"data", "base_model", "sft"}, changed


@pytest.mark.parametrize(
    "statement",
    [
        "from . import late_probe",
        "from .late_probe import VALUE",
        "import {package}.late_probe",
        "importlib.import_module('{package}.late_probe')",
    ],
)
def test_a_module_imported_only_inside_a_function_is_covered(tmp_path, monkeypatch, cfg, statement):
    """``ppo/algorithm.py`` gets a function importing a new module; an edit to that module re-runs PPO
    (and what follows), not SFT, whatever form the import takes."""

    def copy_with_probe(name: str, value: int) -> Path:
        root = _copy(tmp_path, name)
        ppo = _only(root, "ppo/algorithm.py")
        package = ".".join(ppo.parent.relative_to(root.parent).parts)
        body = statement.format(package=package)
        ppo.write_text(f"{ppo.read_text()}\n\ndef _late():\n    import importlib\n\n    {body}\n")
        (ppo.parent / "late_probe.py").write_text(f'"""A module imported late."""\n\nVALUE = {value}\n')
        return root

    first, second = copy_with_probe("before", 1), copy_with_probe("after", 2)
    assert _only(first, "ppo/algorithm.py").read_bytes() == _only(second, "ppo/algorithm.py").read_bytes()
    before = _keys(monkeypatch, cfg, first)
    changed = _changed(before, _keys(monkeypatch, cfg, second))
    assert {"ppo", "evaluation"} <= changed
    assert not changed & {"data", "base_model", "sft"}, changed


def test_an_edit_to_a_stages_table_entry_re_runs_that_stage_and_what_follows(tmp_path, monkeypatch, cfg):
    """The stage table counts entry by entry: an edit to SFT's run function re-runs SFT and
    what reads it; the data and base model stages re-run only if their code imports the table's
    module, which then counts whole."""
    before_root = _copy(tmp_path, "before")
    before = _keys(monkeypatch, cfg, before_root)
    edited = _copy(tmp_path, "edited")
    table = pipeline.__name__
    path = edited.parent.joinpath(*table.split(".")).with_suffix(".py")
    source = path.read_text()
    assert source.count("    from ..train.sft import run_sft\n") == 1
    path.write_text(
        source.replace("    from ..train.sft import run_sft\n", "    from ..train.sft import run_sft  # edited\n")
    )
    changed = _changed(before, _keys(monkeypatch, cfg, edited))
    assert "sft" in changed
    for stage in ("data", "base_model"):
        reached = table in import_closure(before_root, table_entry(before_root, table, stage)[1], table)
        assert (stage in changed) == reached, (stage, changed)


def _finished(root: Path, cfg) -> None:
    """Mark every stage of ``cfg`` finished in the run directory ``root`` with the keys of the
    code now in ``pipeline.SOURCE_ROOT``, as ``rlhf stages`` leaves them (no files besides)."""
    for name, parts in pipeline.key_parts(cfg).items():
        marker = {"key": pipeline.key_of(parts), "status": "done", "manifest": {"files": {}}}
        (root / name).mkdir(parents=True)
        (root / name / "stage.json").write_text(json.dumps({**marker, "parts": pipeline.key_record(parts)}))


def test_the_plan_says_ppo_runs_because_of_its_code_and_names_the_module(tmp_path, monkeypatch, cfg):
    monkeypatch.setattr(pipeline, "SOURCE_ROOT", _copy(tmp_path, "before"))
    _finished(tmp_path / "run", cfg)
    edited = _copy(tmp_path, "edited")
    _edit_docstring(_only(edited, "ppo/algorithm.py"))
    monkeypatch.setattr(pipeline, "SOURCE_ROOT", edited)
    plan = {p.name: p for p in plan_stages(cfg, tmp_path / "run")}
    assert plan["ppo"].reason == "its code changed: rlhf_core/ppo/algorithm.py" and not plan["ppo"].cached
    assert plan["sft"].cached and plan["sft"].reason == f"finished in {tmp_path / 'run' / 'sft'}"
    assert plan["dpo"].cached  # DPO's code holds no ppo.py
    assert "its input ppo changed" in plan["evaluation"].reason


def test_the_plan_names_the_setting_that_changed(tmp_path, cfg):
    _finished(tmp_path / "run", cfg)
    changed = load_config("smoke", ["ppo.kl_coef=0.123"])
    plan = {p.name: p for p in plan_stages(changed, tmp_path / "run")}
    assert plan["ppo"].reason == f"its settings changed: ppo.kl_coef {cfg.ppo.kl_coef!r} -> 0.123"
    assert [p.name for p in plan.values() if not p.cached] == ["ppo", "evaluation"]
    assert plan["evaluation"].reason == "its input ppo changed"
