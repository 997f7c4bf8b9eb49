"""The installed ``rlhf`` command's own arguments: ``sweep`` in the help, its options and
overrides in any order, and its help answered before Prefect is imported."""

import subprocess
import sys
from pathlib import Path

from flows.cli import main, sweep_parser

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_takes_options_and_overrides_in_any_order():
    args = sweep_parser().parse_intermixed_args(["cpu-seeds", "ppo.kl_coef=0.1", "--check", "sft.max_steps=2"])
    assert (args.spec, args.overrides, args.check) == ("cpu-seeds", ["ppo.kl_coef=0.1", "sft.max_steps=2"], True)


def test_help_lists_sweep_and_sweep_help_imports_no_prefect(capsys):
    try:
        main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert "sweep" in capsys.readouterr().out.split("positional arguments:")[1]
    code = (
        "import sys\nfrom flows.cli import main\ntry:\n    main(['sweep', '--help'])\n"
        "except SystemExit as exit_:\n    assert exit_.code == 0\n"
        "assert 'prefect' not in sys.modules and 'mlflow' not in sys.modules, 'imported before parsing'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: rlhf sweep" in done.stdout and "--check" in done.stdout


def test_a_key_in_a_sweep_grid_is_refused_before_any_run_directory_or_store(tmp_path, capsys):
    """``rlhf sweep`` with a key in a grid value and another in an override: refused naming the
    keys, with nothing written (no run directory, no MLflow store) and the values nowhere."""
    grid_key = "sk-ant-" + "api03-" + "Zx9vQ2mN8kL4pR7tY1wE5uI3oA6sD0fG"
    override_key = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456"
    spec = tmp_path / "leak.yaml"
    spec.write_text(f"name: leak\npresets: [smoke]\ngrid:\n  eval.judge_model: [claude-x, {grid_key}]\n")
    out = tmp_path / "out"
    assert main(["sweep", str(spec), "--out", str(out)]) == 2
    assert main(["sweep", "cpu-seeds", f"model.tokenizer={override_key}", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "grid.eval.judge_model (sweep leak): the value looks like a credential" in captured.err
    assert "model.tokenizer (sweep cpu-seeds): the value looks like a credential" in captured.err
    assert grid_key not in captured.out + captured.err and override_key not in captured.out + captured.err
    assert not out.exists()
