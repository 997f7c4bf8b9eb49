"""The container and GPU-pool files: docker/ (images, compose), infra/gpu-pool/ (work-pool base job
templates) and infra/prefect-gpu.yaml (the GPU deployment). Nothing here builds an image or starts
a container: the files are parsed, their pinned versions checked against pyproject.toml's ranges,
and the templates validated and rendered by Prefect's own code, as a worker would render them."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from prefect.server.schemas.actions import validate_base_job_template
from prefect.utilities.schema_tools import ValidationError, is_valid_schema, validate
from prefect.workers.base import BaseJobConfiguration
from pydantic import ConfigDict

from rlhf_core.common.io import PRESET_DIR
from rlhf_core.config.presets import load_config

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TEMPLATES = {
    "docker": REPO / "infra" / "gpu-pool" / "docker-job-template.json",
    "kubernetes": REPO / "infra" / "gpu-pool" / "kubernetes-job-template.json",
}
PINNED = ("prefect", "mlflow", "torch")
#: Images of docker/compose.yaml, by the package whose version their tag carries.
IMAGE_PACKAGE = {
    "rlhf-tldr-prefect-server": "prefect",
    "rlhf-tldr-docker-worker": "prefect",
    "rlhf-tldr-mlflow-server": "mlflow",
}


def requirement_ranges() -> dict[str, SpecifierSet]:
    ranges = {}
    for req in PYPROJECT["project"]["dependencies"]:
        name, spec = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", req).groups()
        ranges[name.lower()] = SpecifierSet(spec)
    return ranges


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined and comments dropped."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, flags=re.M)]


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def deployment_file() -> dict:
    return yaml.safe_load((REPO / "infra" / "prefect-gpu.yaml").read_text())


def gpu_deployment() -> dict:
    (dep,) = [d for d in deployment_file()["deployments"] if d["name"] == "full-pipeline-gpu"]
    return dep


def template(kind: str) -> dict:
    return json.loads(TEMPLATES[kind].read_text())


def pins() -> list[tuple[str, str, str]]:
    """Every pinned prefect, mlflow and torch version in docker/: ``(package, version, where)``."""
    found = []
    for path in sorted(DOCKER.iterdir()):
        if not path.is_file():
            continue
        text = path.read_text()
        for name, version in re.findall(r"(?<![\w-])(prefect|mlflow|torch)\s*==\s*([0-9][^\s\"',;\]]*)", text):
            found.append((name, version, path.name))
        for name, version in re.findall(r"\b(PREFECT|MLFLOW|TORCH)_VERSION\s*=\s*([0-9][^\s\"']*)", text):
            found.append((name.lower(), version, path.name))
    for name, service in compose()["services"].items():
        image, _, tag = service.get("image", "").partition(":")
        if image in IMAGE_PACKAGE:
            found.append((IMAGE_PACKAGE[image], tag, f"compose.yaml:{name}"))
    return found


def constraints() -> dict[str, str]:
    out = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name.strip().lower()] = version.strip()
    return out


# ---------------------------------------------------------------- versions


def test_pinned_versions_fall_inside_pyproject_ranges():
    ranges = requirement_ranges()
    found = pins()
    assert {name for name, _, _ in found} >= set(PINNED), found
    outside = [(n, v, where, str(ranges[n])) for n, v, where in found if Version(v) not in ranges[n]]
    assert not outside, f"pins outside pyproject.toml's ranges: {outside}"
    by_package: dict[str, set[str]] = {}
    for name, version, _ in found:
        by_package.setdefault(name, set()).add(version)
    assert all(len(v) == 1 for v in by_package.values()), f"one package pinned at two versions: {by_package}"


def test_every_constraint_falls_inside_pyproject_ranges():
    ranges = requirement_ranges()
    pinned = constraints()
    assert set(PINNED) <= pinned.keys()
    for name, version in pinned.items():
        if name in ranges:
            assert Version(version) in ranges[name], (name, version, str(ranges[name]))


def test_torch_pin_is_the_makefiles_torch():
    makefile = (REPO / "Makefile").read_text()
    torch = re.search(r"^TORCH_VERSION \?= (\S+)$", makefile, flags=re.M).group(1)
    assert torch == constraints()["torch"] == lock()["torch"]


# ---------------------------------------------------------------- the lock file


def lock() -> dict[str, str]:
    """requirements.lock as ``{package: version}`` (names normalised as PEP 503 does)."""
    out = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def all_requirements() -> list[str]:
    project = PYPROJECT["project"]
    return project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]


def test_the_lock_pins_every_requirement_inside_its_range():
    pinned = lock()
    missing, outside = [], []
    for req in all_requirements():
        name, extras, spec = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", req).groups()
        name = re.sub(r"[-_.]+", "-", name).lower()
        if name not in pinned:
            missing.append(name)
        elif Version(pinned[name]) not in SpecifierSet(spec):
            outside.append((name, pinned[name], spec))
    assert not missing, f"requirements.lock does not pin {missing}: run `make lock`"
    assert not outside, f"requirements.lock pins outside pyproject.toml's ranges: {outside}"
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.]*", v) for v in pinned.values())  # exact, no local labels


def test_the_images_constraints_agree_with_the_lock():
    pinned = lock()
    differ = {n: (v, pinned[n]) for n, v in constraints().items() if n in pinned and pinned[n] != v}
    assert not differ, f"docker/constraints.txt and requirements.lock differ (constraint, lock): {differ}"


def test_every_install_goes_through_the_lock():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("$(STAMP):") :].split("\n\n", 1)[0]
    assert "CONSTRAINTS='-c $(LOCK)' packages" in recipe and "$(LOCK)" in recipe.splitlines()[0]
    assert re.search(r"^LOCK := requirements\.lock$", makefile, flags=re.M)
    packages = makefile[makefile.index("\npackages:") :].split("\n\n", 1)[0]
    installs = [ln for ln in packages.splitlines() if "pip install" in ln and "--upgrade pip" not in ln]
    assert len(installs) == 3 and all("$(CONSTRAINTS)" in ln for ln in installs)
    for dockerfile in ("worker.Dockerfile", "server.Dockerfile"):
        runs = [a for i, a in dockerfile_instructions(DOCKER / dockerfile) if i == "RUN" and "pip install" in a]
        for run in runs:
            for install in (i.split("&&")[0] for i in run.split("pip install")[1:]):
                if "--no-deps --editable ." not in install:  # the project itself, nothing else
                    assert "requirements.lock" in install, (dockerfile, install)
        copies = [a for i, a in dockerfile_instructions(DOCKER / dockerfile) if i == "COPY"]
        assert any(c.startswith("requirements.lock ") for c in copies), dockerfile


@pytest.mark.parametrize("dockerfile", ["worker.Dockerfile", "server.Dockerfile"])
def test_base_images_are_pinned_python_in_requires_python(dockerfile):
    instructions = dockerfile_instructions(DOCKER / dockerfile)
    args = dict(re.match(r"(\w+)=(\S+)", a).groups() for i, a in instructions if i == "ARG" and "=" in a)
    stages = set()
    for inst, arg in instructions:
        if inst != "FROM":
            continue
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], arg.split()[0])
        if ref in stages:
            continue
        stages.update(re.findall(r"\bAS\s+(\S+)", arg, flags=re.I))
        repo, _, tag = ref.partition(":")
        assert repo == "python" and tag and tag != "latest", ref
        version = re.match(r"(\d+\.\d+\.\d+)-", tag).group(1)
        assert Version(version) in SpecifierSet(PYPROJECT["project"]["requires-python"]), ref


# ---------------------------------------------------------------- images


def test_worker_image_is_a_job_image_of_the_project():
    instructions = dockerfile_instructions(DOCKER / "worker.Dockerfile")
    kinds = [i for i, _ in instructions]
    assert "ENTRYPOINT" not in kinds  # Prefect's worker supplies the flow-run command
    (workdir,) = [a for i, a in instructions if i == "WORKDIR"]
    assert workdir == "/opt/rlhf"
    users = [a for i, a in instructions if i == "USER"]
    assert users and users[-1] not in ("root", "0")
    (cmd,) = [a for i, a in instructions if i == "CMD"]
    assert "worker" not in cmd
    env = " ".join(a for i, a in instructions if i == "ENV")
    for setting in (
        "DO_NOT_TRACK=1",
        "PREFECT_SERVER_ANALYTICS_ENABLED=false",
        "MLFLOW_DISABLE_TELEMETRY=true",
        "HF_HUB_DISABLE_TELEMETRY=1",
        "RLHF_WORK_DIR=/var/lib/rlhf/",
    ):
        assert setting in env, setting
    runs = [a for i, a in instructions if i == "RUN"]
    assert any("offline-models" in r and "--no-deps" in r for r in runs)
    assert any("--editable ." in r for r in runs)


@pytest.mark.parametrize("dockerfile", ["worker.Dockerfile", "server.Dockerfile"])
def test_copied_paths_exist_and_are_in_the_build_context(dockerfile):
    ignored = {
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    }
    for inst, arg in dockerfile_instructions(DOCKER / dockerfile):
        if inst == "COPY" and "--from" not in arg:
            for src in arg.split()[:-1]:
                assert (REPO / src).exists(), src
                assert src.split("/")[0] not in ignored, src


def test_dockerignore_keeps_local_state_out_of_the_context():
    entries = set((REPO / ".dockerignore").read_text().split())
    for entry in (".venv", "runs", ".stack", "mlruns", "mlartifacts", ".git", ".rlhf-work"):
        assert entry in entries, entry
    assert {"*.db", "**/*.db"} & entries and {"__pycache__", "**/__pycache__"} & entries


def test_compose_servers_are_pinned_local_and_quiet():
    services = compose()["services"]
    assert {"prefect-server", "mlflow-server"} <= services.keys()
    targets = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (DOCKER / "server.Dockerfile").read_text(), flags=re.M))
    declared_volumes = set(compose().get("volumes") or {})
    for name, service in services.items():
        env = service.get("environment") or {}
        assert env.get("DO_NOT_TRACK") == "1" and env.get("PREFECT_SERVER_ANALYTICS_ENABLED") == "false", name
        assert env.get("MLFLOW_DISABLE_TELEMETRY") == "true", name
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
        build = service["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).is_file()
        assert build["target"] in targets, (name, build["target"])
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith("/") or source in declared_volumes, (name, volume)
    mlflow = services["mlflow-server"]
    assert mlflow["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    command = mlflow["command"]
    assert command[command.index("--workers") + 1] == "1"
    assert "--artifacts-destination" in command and "--backend-store-uri" in command
    assert "4200" in services["prefect-server"]["ports"][0] and "5000" in mlflow["ports"][0]


# ---------------------------------------------------------------- work-pool templates


class _Rendered(BaseJobConfiguration):
    """Prefect's base job configuration, keeping the worker-specific fields it renders."""

    model_config = ConfigDict(extra="allow")


class _NoClient:
    """Stands in for the API client: these templates reference no blocks and no variables."""

    def __getattr__(self, name):
        raise AssertionError(f"rendering needed the Prefect API ({name})")


def render(kind: str, job_variables: dict) -> dict:
    """The job configuration a worker of ``kind`` would get for a run with ``job_variables``."""
    config = asyncio.run(_Rendered.from_template_and_values(template(kind), job_variables, client=_NoClient()))
    rendered = config.model_dump()
    assert "{{" not in json.dumps(rendered), "a placeholder was left unrendered"
    return rendered


def defaults(kind: str) -> dict:
    return {k: v["default"] for k, v in template(kind)["variables"]["properties"].items() if "default" in v}


@pytest.mark.parametrize("kind", TEMPLATES)
def test_template_passes_prefects_validation(kind):
    base = template(kind)
    assert set(base) == {"job_configuration", "variables"}
    validate_base_job_template(base)  # every placeholder is a declared variable
    is_valid_schema(base["variables"], preprocess=False)
    job_variables = {**defaults(kind), **gpu_deployment()["work_pool"]["job_variables"]}
    validate(
        job_variables,
        base["variables"],
        raise_on_error=True,
        preprocess=True,
        ignore_required=True,
        allow_none_with_default=True,
    )
    with pytest.raises(ValidationError):
        validate({"gpus": "two"}, base["variables"], raise_on_error=True, ignore_required=True)


@pytest.mark.parametrize("gpus", [None, 2])
def test_docker_template_requests_nvidia_gpus(gpus):
    job_variables = dict(gpus=gpus) if gpus else {}
    rendered = render("docker", job_variables)
    (request,) = rendered["container_create_kwargs"]["device_requests"]
    assert request["driver"] == "nvidia" and request["capabilities"] == [["gpu"]]
    assert request["count"] == (gpus or 1)
    assert rendered["image"] == gpu_deployment()["work_pool"]["job_variables"]["image"]
    assert set(rendered["env"]) >= {"MLFLOW_TRACKING_URI", "RLHF_ARTIFACT_ROOT"}
    assert rendered["env"]["RLHF_NPROC_PER_NODE"] == str(gpus or 1)  # one training rank per GPU
    (volume,) = rendered["volumes"]
    assert volume.endswith(":/var/lib/rlhf")  # the job image's RLHF_WORK_DIR, cache and artifacts


@pytest.mark.parametrize("gpus", [None, 2])
def test_kubernetes_template_requests_nvidia_gpus(gpus):
    job_variables = dict(gpus=gpus) if gpus else {}
    rendered = render("kubernetes", job_variables)
    pod = rendered["job_manifest"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == str(gpus or 1)
    assert "cpu" not in container["resources"]["limits"]  # unset variables leave no nulls behind
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {}
    assert container["image"] == gpu_deployment()["work_pool"]["job_variables"]["image"]
    assert set(rendered["env"]) >= {"MLFLOW_TRACKING_URI", "RLHF_ARTIFACT_ROOT"}
    assert rendered["env"]["RLHF_ARTIFACT_ROOT"].startswith("s3://")
    assert rendered["env"]["RLHF_NPROC_PER_NODE"] == str(gpus or 1)  # one training rank per GPU


@pytest.mark.parametrize("kind", TEMPLATES)
def test_deployment_env_is_merged_with_the_templates_env(kind):
    job_variables = gpu_deployment()["work_pool"]["job_variables"]
    rendered = render(
        kind,
        {**job_variables, "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"}}
        if kind == "kubernetes"
        else job_variables,
    )
    assert rendered["env"]["PREFECT_LOGGING_EXTRA_LOGGERS"] == "rlhf_core"
    assert rendered["env"]["MLFLOW_TRACKING_URI"].startswith("http")
    if kind == "kubernetes":
        pod = rendered["job_manifest"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}


# ---------------------------------------------------------------- the GPU deployment


def test_gpu_deployment_runs_the_flow_from_the_image():
    spec = deployment_file()
    dep = gpu_deployment()
    assert spec["prefect-version"] == constraints()["prefect"]
    path, _, function = dep["entrypoint"].partition(":")
    assert (path, function) == ("flows/pipeline.py", "rlhf")
    tree = ast.parse((REPO / path).read_text())
    (flow_fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    assert any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "flow" for d in flow_fn.decorator_list)
    # The code is in the image: one step, into the image's WORKDIR, and nothing fetched.
    (step,) = spec["pull"]
    assert step == {"prefect.deployments.steps.set_working_directory": {"directory": "/opt/rlhf"}}
    assert not spec.get("build") and not spec.get("push")


def test_gpu_deployment_preset_pool_and_image():
    dep = gpu_deployment()
    preset = dep["parameters"]["preset"]
    assert (PRESET_DIR / f"{preset}.yaml").is_file()
    assert load_config(preset).name == preset
    pool = dep["work_pool"]
    assert pool["name"] == "rlhf-gpu"
    worker = compose()["services"]["docker-worker"]["command"]
    assert worker[worker.index("--pool") + 1] == pool["name"]
    job_variables = pool["job_variables"]
    assert job_variables["gpus"] >= 1
    for kind in TEMPLATES:
        properties = template(kind)["variables"]["properties"]
        assert set(job_variables) <= set(properties), kind
        assert properties["image"]["default"] == job_variables["image"]
    assert job_variables["image"] == f"rlhf-tldr-worker:{PYPROJECT['project']['version']}"


def test_the_offline_gpu_bundle_pins_every_package_it_carries_and_its_scripts_parse():
    """`make gpu-bundle` (infra/offline-gpu/prepare.sh) downloads each default package at the
    lock's version and stops on one the lock lacks: every name in its list must be pinned."""
    import subprocess

    script = REPO / "infra" / "offline-gpu" / "prepare.sh"
    text = script.read_text()
    listed = re.search(r'default_packages="([^"]+)"', text).group(1).split()
    pinned = lock()
    assert len(listed) >= 10
    assert not [p for p in listed if re.sub(r"[-_.]+", "-", p).lower() not in pinned]
    for path in (script, script.with_name("env.sh")):
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, path
    makefile = (REPO / "Makefile").read_text()
    assert "infra/offline-gpu/prepare.sh" in makefile[makefile.index("\ngpu-bundle:") :].split("\n\n", 1)[0]


def test_the_gpu_machines_versions_are_checked_against_the_projects_ranges(tmp_path):
    """env.sh runs infra/offline-gpu/check_versions.py: an installed package outside
    pyproject.toml's range is named with the range and fails the check; one not installed is
    listed, not failed; this environment meets the project's own ranges."""

    script = REPO / "infra" / "offline-gpu" / "check_versions.py"
    assert "check_versions.py" in (script.with_name("env.sh")).read_text()
    ok = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\ndependencies = ["packaging>=9999", "no-such-package-here>=1", "pyyaml>=5",'
        " \"tomli>=1; python_version < '3.0'\"]\n"
    )
    bad = subprocess.run([sys.executable, str(script), "--pyproject", str(pyproject)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "packaging" in bad.stderr and "outside the project's range packaging>=9999" in bad.stderr
    assert "pyyaml" not in bad.stderr.lower()
    assert "no-such-package-here" in bad.stdout and "tomli" not in bad.stdout


@pytest.mark.xdist_group("group-check")
def test_a_grouped_test_carries_its_group_under_loadgroup(request):
    """`make test`'s ``--dist loadgroup`` keeps each ``xdist_group`` in one process (the server
    stack and the first pipeline run are started once): the test's id names its group."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@group-check")


def _make_env(tmp_path, *args: str, env: dict[str, str]) -> dict[str, str]:
    """The hub settings a recipe of the Makefile runs with, for ``make ARGS`` in ``env``."""
    names = (
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY",
        "RLHF_TLDR_DIR",
    )
    show = "show-env: ; @" + " ".join(f'echo "{n}=$${n}";' for n in names)
    out = subprocess.run(
        ["make", "--no-print-directory", "-s", "--eval", show, "show-env", *args],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k not in names} | env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def test_the_makefile_keeps_the_hub_offline_only_for_an_offline_preset_with_its_rows(tmp_path):
    """Offline presets (models in PyPI packages) with a rows folder run with the hub off; one
    without rows reaches the hub for them, and so does a preset that reads the hub. Telemetry stays
    off everywhere; the folder beside the repository is used only where it exists."""
    rows = tmp_path / "tldr"
    rows.mkdir()
    (rows / "sft_validation.jsonl").write_text("{}\n")
    for preset in ("cpu-demo", "smoke"):
        env = _make_env(tmp_path, f"PRESET={preset}", f"SHARED_TLDR={rows}", env={})
        assert env["RLHF_TLDR_DIR"] == str(rows) and env["HF_HUB_OFFLINE"] == "1" == env["TRANSFORMERS_OFFLINE"]
    none = _make_env(tmp_path, "PRESET=cpu-demo", f"SHARED_TLDR={tmp_path / 'absent'}", env={})
    assert none["RLHF_TLDR_DIR"] == "" and none["HF_HUB_OFFLINE"] == "" == none["HF_DATASETS_OFFLINE"]
    given = _make_env(tmp_path, "PRESET=cpu-demo", env={"RLHF_TLDR_DIR": str(rows)})
    assert given["HF_HUB_OFFLINE"] == "1"
    for preset in ("pythia-1b", "llama-3.2-1b-h200"):
        hub = _make_env(tmp_path, f"PRESET={preset}", f"SHARED_TLDR={rows}", env={})
        assert hub["HF_HUB_OFFLINE"] == "" and hub["HF_HUB_DISABLE_TELEMETRY"] == "1"


def test_make_demo_checks_the_run_before_it_starts_the_servers():
    dry_run = ["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "demo"]  # no install
    recipe = subprocess.run(dry_run, cwd=REPO, capture_output=True, text=True, timeout=60).stdout.splitlines()
    check = next(i for i, line in enumerate(recipe) if "/rlhf check --preset cpu-demo" in line)
    assert check < next(i for i, line in enumerate(recipe) if "stack-up" in line or "stack.sh up" in line)
