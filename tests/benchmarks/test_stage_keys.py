"""The re-key table (benchmarks/stage_keys.py): which stages' keys an edit to each module changes,
and the targets it is held to: no plotting, HTML or report module re-keys a training stage, and at
most six modules re-key nine or more stages."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stage_keys.py"
spec = importlib.util.spec_from_file_location("stage_keys", SCRIPT)
stage_keys = importlib.util.module_from_spec(spec)
sys.modules["stage_keys"] = stage_keys
spec.loader.exec_module(stage_keys)


def test_the_package_meets_the_targets(capsys):
    table = stage_keys.rekeyed()
    assert stage_keys.misses(table) == []
    assert stage_keys.main(["--check"]) == 0
    assert "targets met" in capsys.readouterr().out
    # what an edit costs, for a few modules whose place is known
    assert table["rlhf_core/ppo/algorithm.py"] == ["ppo", "evaluation", "policy_eval"]
    assert table["rlhf_core/views/plots.py"] == ["reward_eval", "dpo_eval", "evaluation", "policy_eval"]
    assert table["rlhf_core/views/page.py"] == table["rlhf_core/report/run_report.py"] == ["evaluation", "policy_eval"]
    assert table["rlhf_core/evaluation/policies.py"] == table["rlhf_core/report/policy_report.py"] == ["policy_eval"]
    assert table["rlhf_core/run/cli.py"] == []


def test_the_json_lists_every_module(capsys):
    assert stage_keys.main(["--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    from rlhf_core.common.stage_code import runs_nothing

    files = (SCRIPT.parents[1] / "rlhf_core").rglob("*.py")
    modules = {p.relative_to(SCRIPT.parents[1]).as_posix() for p in files if not runs_nothing(p)}
    assert set(printed) == modules and "rlhf_core/__init__.py" in modules  # the version: it runs


def test_a_missed_target_is_named():
    table = {m: ["evaluation"] for m in stage_keys.PRESENTATION}
    table["rlhf_core/views/plots.py"] = ["reward_eval", "ppo"]
    run = list(stage_keys.STAGES)[: stage_keys.WIDE]
    wide = {f"rlhf_core/m{i}.py": run for i in range(stage_keys.MOST_WIDE + 1)}
    missed = stage_keys.misses(table | wide)
    assert missed[0] == "rlhf_core/views/plots.py (presentation) re-keys the training stage ppo"
    assert missed[1].startswith(f"{stage_keys.MOST_WIDE + 1} modules re-key {stage_keys.WIDE} or more stages")
    assert stage_keys.misses(table | dict(list(wide.items())[:-1])) == missed[:1]
    # a stage run on demand (rlhf evaluate) is not one of a run's: it does not make a module wide
    on_demand = {f"rlhf_core/m{i}.py": run[:-1] + ["policy_eval"] for i in range(stage_keys.MOST_WIDE + 1)}
    assert stage_keys.misses(table | on_demand) == missed[:1]


def test_the_development_page_shows_the_table_as_it_is():
    """docs/development.md holds the script's table; regenerate it with
    ``benchmarks/stage_keys.py`` after a change of imports."""
    page = (SCRIPT.parents[1] / "docs" / "development.md").read_text()
    assert stage_keys.markdown(stage_keys.rekeyed()) in page
