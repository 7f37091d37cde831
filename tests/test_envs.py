"""Every conda env file (envs/*.yaml) holds what the rules that use it import, and no more.

For each env file, an environment holding only what the file names is built and every module its
rules run is imported in it, in a fresh interpreter. Building real conda environments needs the
network and many minutes per file, so the environment is the pip equivalent assembled from this
test run's own installation: each distribution the file names, with its declared requirements
(markers evaluated, extras left out), resolved recursively and linked into an empty directory;
the interpreter runs with ``-I -S`` (no site-packages, no PYTHONPATH) and that directory plus
``src/`` as its only non-standard-library paths. A module a rule needs but its env file does not
name (directly or through a named package's requirements) fails to import there.

"The modules its rules run": the rule's ``script:`` and, transitively, every ``vidlabel`` module
it imports, including imports inside functions (run only on some paths, e.g. a backend chosen by
the config). Imports inside ``try: ... except ImportError`` are optional by design and are only
imported where the env names them. The same walk checks the other direction: every package an env
names is imported by one of its modules.

Why it matters although a local run works: Snakemake appends its own installation's ``sys.path`` to
every job's, so a package missing from a conda env is silently imported from the Snakemake
installation where both use the same Python, and fails (or loads a build for the wrong Python) on a
cluster where they do not.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
ENVS = REPO / "envs"
# Conda names of things that are not Python distributions: checked as programs on PATH.
PROGRAMS = {"ffmpeg": "ffmpeg"}
NOT_PACKAGES = {"python", "pip"}
# Requirements of named packages that this installation leaves out on purpose (the Makefile installs
# openai-whisper with --no-deps after a CPU torch): never imported on the CPU path.
LEFT_OUT = {"triton": "openai-whisper's CUDA kernels; not installed here (see the Makefile)"}
STDLIB = set(sys.stdlib_module_names)


def env_files() -> list[Path]:
    return sorted(ENVS.glob("*.yaml"))


def rules_by_env() -> dict[str, list[tuple[str, Path]]]:
    """env file name -> [(rule, script path)] from workflow/rules/*.smk."""
    out: dict[str, list[tuple[str, Path]]] = {}
    pattern = re.compile(r"^rule (\w+):(.*?)(?=^rule |\Z)", re.S | re.M)
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for name, body in pattern.findall(smk.read_text()):
            conda = re.search(r"conda:\s*\n\s*\"([^\"]+)\"", body)
            script = re.search(r"script:\s*\n\s*\"([^\"]+)\"", body)
            assert conda and script, f"rule {name} in {smk.name} lacks conda: or script:"
            env = (smk.parent / conda.group(1)).resolve()
            out.setdefault(env.name, []).append((name, (smk.parent / script.group(1)).resolve()))
    return out


def env_packages(path: Path) -> tuple[list[Requirement], list[str]]:
    """(pip requirements, programs) an env file names; conda specs such as ``av>=12`` read as pip's."""
    deps = yaml.safe_load(path.read_text())["dependencies"]
    reqs, programs = [], []
    for dep in deps:
        for spec in dep["pip"] if isinstance(dep, dict) else [dep]:
            name = re.split(r"[<>=!~ ]", spec, maxsplit=1)[0]
            if name in NOT_PACKAGES:
                continue
            if name in PROGRAMS:
                programs.append(PROGRAMS[name])
                continue
            reqs.append(Requirement(spec.replace(" ", "")))
    return reqs, programs


class _Imports(ast.NodeVisitor):
    """Absolute module names imported by a file: (name, optional) where optional means inside a
    ``try`` whose handlers catch ImportError (or ModuleNotFoundError)."""

    def __init__(self, package: str | None):
        self.package = package
        self.found: set[tuple[str, bool]] = set()
        self._optional = 0

    def visit_Try(self, node: ast.Try) -> None:
        catches = any(_catches_import_error(h.type) for h in node.handlers)
        self._optional += catches
        for stmt in node.body:
            self.visit(stmt)
        self._optional -= catches
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.add((alias.name, self._optional > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level and self.package is None:
            return  # a relative import in a file outside any package: nothing to resolve
        if node.level:
            base = self.package.rsplit(".", node.level - 1)[0] if node.level > 1 else self.package
            module = f"{base}.{node.module}" if node.module else base
            names = [f"{module}.{a.name}" for a in node.names] if not node.module else [module]
        else:
            module = node.module
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        for name in names:
            self.found.add((name, self._optional > 0))


def _catches_import_error(expr) -> bool:
    if expr is None:
        return True  # a bare except
    names = [e.id for e in (expr.elts if isinstance(expr, ast.Tuple) else [expr]) if isinstance(e, ast.Name)]
    return bool({"ImportError", "ModuleNotFoundError", "Exception"} & set(names))


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] != "vidlabel":
        return None
    base = REPO / "src" / Path(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None  # vidlabel.x.attr: an attribute, not a module


def modules_run_by(scripts: list[Path]) -> tuple[set[str], set[str], set[str]]:
    """(vidlabel modules, required third-party top-level names, optional ones) the scripts run."""
    seen: set[str] = set()
    required: set[str] = set()
    optional: set[str] = set()
    todo: list[tuple[Path, str | None]] = [(s, s.parent.name if (s.parent / "__init__.py").exists() else None)
                                           for s in scripts]
    while todo:
        path, package = todo.pop()
        visitor = _Imports(package)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for name, is_optional in visitor.found:
            top = name.split(".")[0]
            if top == "vidlabel":
                file = _module_file(name)
                if file and name not in seen:
                    seen.add(name)
                    todo.append((file, name if file.name == "__init__.py" else name.rsplit(".", 1)[0]))
            elif top not in STDLIB and top != "__future__":
                (optional if is_optional else required).add(top)
    return seen, required - {"snakemake"}, optional - required


def resolve(reqs: list[Requirement]) -> tuple[dict[str, md.Distribution], list[str]]:
    """Installed distributions for ``reqs`` and their requirements, recursively; problems found."""
    env = default_environment()
    dists: dict[str, md.Distribution] = {}
    problems: list[str] = []
    todo = [(r, "the env file") for r in reqs]
    while todo:
        req, wanted_by = todo.pop()
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in dists:
            continue
        if key in LEFT_OUT:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{req} (wanted by {wanted_by}) is not installed here")
            continue
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            problems.append(f"{req} (wanted by {wanted_by}): the installed {dist.version} does not satisfy it; "
                            "the tests ran against a version the env file excludes")
        dists[key] = dist
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({**env, "extra": ""}):
                todo.append((sub, dist.metadata["Name"]))
    return dists, problems


def link_site(dists: dict[str, md.Distribution], site: Path) -> None:
    """An import directory holding only these distributions (their top-level files, linked)."""
    site.mkdir()
    for dist in dists.values():
        root = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = root / top
            if src.exists() and not (site / top).exists():
                os.symlink(src, site / top)


def distribution_of(top: str) -> set[str]:
    return {re.sub(r"[-_.]+", "-", d).lower() for d in md.packages_distributions().get(top, [])}


ENV_NAMES = [p.name for p in env_files()]


def test_every_rule_has_an_env_file_and_every_env_file_a_rule():
    used = rules_by_env()
    assert set(used) == set(ENV_NAMES), (sorted(used), ENV_NAMES)


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_env_imports_every_module_its_rules_run(env_name, tmp_path):
    rules = rules_by_env()[env_name]
    reqs, programs = env_packages(ENVS / env_name)
    for program in programs:
        assert shutil.which(program), f"{env_name} names {program}, which this machine lacks on PATH"
    dists, problems = resolve(reqs)
    assert not problems, f"{env_name}: " + "; ".join(problems)
    site = tmp_path / "site"
    link_site(dists, site)
    vidlabel_modules, required, optional = modules_run_by([script for _, script in rules])
    wanted = sorted(vidlabel_modules | required
                    | {top for top in optional if distribution_of(top) & set(dists)})
    code = (
        "import importlib, sys, traceback\n"
        f"sys.path[:0] = [{str(site)!r}, {str(REPO / 'src')!r}]\n"
        "failed = []\n"
        f"for name in {wanted!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path)
    assert result.returncode == 0, (
        f"{env_name} (rules {', '.join(r for r, _ in rules)}) cannot import:\n{result.stdout}{result.stderr[-3000:]}")
    # The walk reached the package's stage modules (the scripts are only adapters).
    assert len(vidlabel_modules) >= 3, vidlabel_modules


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_env_names_exactly_what_its_rules_import(env_name):
    """Every package a rule imports is named itself (not only reached through another package's
    requirements, which may change), and every named package is imported."""
    rules = rules_by_env()[env_name]
    reqs, _ = env_packages(ENVS / env_name)
    named = {re.sub(r"[-_.]+", "-", r.name).lower() for r in reqs}
    _, required, optional = modules_run_by([script for _, script in rules])
    imported = set()
    for top in required | optional:
        imported |= distribution_of(top)
    unnamed = sorted(top for top in required if not distribution_of(top) & named)
    assert not unnamed, f"{env_name} does not name what provides {unnamed}, which its rules import"
    unused = sorted(r.name for r in reqs if re.sub(r"[-_.]+", "-", r.name).lower() not in imported)
    assert not unused, f"{env_name} names {unused}, which none of its rules' modules import"


def test_pyproject_declares_exactly_what_the_package_imports():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {re.sub(r"[-_.]+", "-", Requirement(r).name).lower() for r in project["dependencies"]}
    extras = {re.sub(r"[-_.]+", "-", Requirement(r).name).lower()
              for group in project["optional-dependencies"].values() for r in group}
    scripts = sorted((REPO / "scripts").glob("*.py")) + [REPO / "Snakefile"]
    _, required, optional = modules_run_by(
        [p for p in sorted((REPO / "src" / "vidlabel").rglob("*.py"))] + [p for p in scripts if p.suffix == ".py"])
    snakefile_imports = {"snakemake"}  # the Snakefile's own (it is not Python source ast can read)
    imported_core = set()
    for top in required | snakefile_imports:
        dists = distribution_of(top)
        assert dists, f"{top} is imported by the package but no installed distribution provides it"
        assert dists & (core | extras), f"{top} ({sorted(dists)}) is imported by the package but not declared"
        imported_core |= dists
    for top in optional:
        imported_core |= distribution_of(top)
    # The SLURM executor is a plugin Snakemake loads by name (profiles/slurm: executor: slurm).
    plugins = {"snakemake-executor-plugin-slurm"}
    unused = sorted(core - imported_core - plugins)
    assert not unused, f"pyproject.toml declares {unused}, which nothing in src/ or scripts/ imports"


def test_tests_and_benchmarks_import_only_declared_packages():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {re.sub(r"[-_.]+", "-", Requirement(r).name).lower()
                for r in [*project["dependencies"], *(r for g in project["optional-dependencies"].values() for r in g)]}
    files = sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "benchmarks").glob("*.py"))
    local = {p.stem for p in files} | {p.name for p in (REPO / "tests").iterdir() if p.is_dir()}
    _, required, optional = modules_run_by(files)
    missing = sorted(top for top in required - local if not distribution_of(top) & declared)
    assert not missing, f"tests/ or benchmarks/ import {missing}, which pyproject.toml does not declare"


def test_a_renamed_config_key_says_what_to_write_instead():
    from vidlabel.core import config as vconfig

    old = {"posts": "p.csv", "media_root": "/m", "classify": {"tensor_parallel_size": 4}}
    with pytest.raises(vconfig.ConfigError) as err:
        vconfig.validate(old)
    assert "config key 'classify.tensor_parallel_size' was renamed; write classify.parallelism: " \
           "{tensor: N, data: 1}" in str(err.value)
    # The key that replaced it is accepted.
    new = vconfig.validate({"posts": "p.csv", "media_root": "/m", "classify": {"parallelism": {"tensor": 4}}})
    assert new["classify"]["parallelism"]["tensor"] == 4
