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
