"""Packaging: `python -m build` makes an sdist and a wheel that carry the right files, and the wheel installs
and computes a loss away from the source checkout.

How the distributions are built (once per module, about 20-30 s on a 2-core machine):
  * from a copy of the checkout in a temp dir, so setuptools' build/ and *.egg-info never land in the real
    working tree, with some junk planted in the copy (a .venv, __pycache__/*.pyc, a stray .so) that must not
    end up in either archive;
  * `python -m build --no-isolation` with no --sdist/--wheel flags: build makes the sdist, unpacks it and
    builds the wheel FROM THE SDIST, so a file missing from the sdist breaks the wheel too. --no-isolation
    uses the setuptools of the current environment: an isolated build would create a venv and download
    setuptools from the package index on every run (slower, and it needs an index; CI is offline-ish);
  * with ANGLE_KERNELS_BUILD_CUDA=0: these tests check packaging, not nvcc, and on a machine with CUDA torch
    the extension build would take minutes (tests/test_csrc_compile.py covers the CUDA sources).

The default tests install the wheel with `pip install --no-deps --target DIR` and import it from DIR in a
subprocess (torch from the current environment). The full check, a fresh venv that installs torch (pinned to
the running torch's version) and then the wheel with the [train] extra from the package index, takes a few
minutes and needs the index: opt in with ANGLE_KERNELS_TEST_FRESH_VENV=1.
"""

from __future__ import annotations

import ast
import configparser
import email.parser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

if importlib.util.find_spec("build") is None:
    pytest.skip(
        "the `build` package is not installed (pip install build, or the [test] extra): cannot test packaging",
        allow_module_level=True,
    )

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("angle_kernels", "angle_train")
# Subpackages the wheel must carry whatever the file listing of the source tree says.
REQUIRED_SUBPACKAGES = ("angle_kernels/torch_ops", "angle_kernels/triton_ops", "angle_kernels/cuda_ops")
OPTIONAL_SUBPACKAGES = ("angle_kernels/integrations",)  # required when the source tree has it
CSRC_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
TOP_LEVEL_FILES = ("README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml", "setup.py", "MANIFEST.in", "PKG-INFO")
EXTRAS = ("train", "bench", "test", "tracking", "triton")

# What the copy of the checkout leaves out: version control, environments and build outputs. tests/ and bench/
# ARE copied, so "the sdist has no tests" is a real check of MANIFEST.in.
COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "venv", ".tox", ".nox", "build", "dist", "*.egg-info", ".hypothesis", ".pytest_cache",
    ".benchmarks", ".torch_extensions", "runs", ".whl", ".gl", "__pycache__",
)
# Junk planted in the copy, none of which may reach an archive.
PLANTED_JUNK = (
    ".venv/lib/python3/site-packages/junk.py",
    "angle_kernels/__pycache__/functional.cpython-311.pyc",
    "angle_kernels/_C.cpython-311-x86_64-linux-gnu.so",
    "csrc/pair_scores.o",
)

BUILD_TIMEOUT_S = 300
PIP_TIMEOUT_S = 300
RUN_TIMEOUT_S = 180
FRESH_VENV_PIP_TIMEOUT_S = 1200

# Runs in a separate interpreter against the INSTALLED package: argv = [expected install dir, expected version].
# It checks where angle_kernels was imported from, its version (attribute and installed metadata), that every
# subpackage imports, and one loss (CoSENT) against a dense float64 reference, value and gradient.
INSTALLED_PACKAGE_CHECK = r'''
import importlib
import importlib.metadata
import os
import sys

import torch

expected_dir, expected_version = os.path.realpath(sys.argv[1]), sys.argv[2]
import angle_kernels

location = os.path.realpath(angle_kernels.__file__)
assert location.startswith(expected_dir + os.sep), f"angle_kernels imported from {location}, not {expected_dir}"
assert angle_kernels.__version__ == expected_version, (angle_kernels.__version__, expected_version)
assert importlib.metadata.version("angle-kernels") == expected_version, importlib.metadata.version("angle-kernels")
for name in ("angle_kernels.torch_ops", "angle_kernels.triton_ops", "angle_kernels.cuda_ops",
             "angle_kernels.integrations", "angle_kernels.modules", "angle_train", "angle_train.cli"):
    module = importlib.import_module(name)
    assert os.path.realpath(module.__file__).startswith(expected_dir + os.sep), (name, module.__file__)


def cosent_reference(labels, emb, tau):
    """Dense float64 CoSENT: log(1 + sum over pairs i, j with label_i < label_j of exp(tau (cos_i - cos_j)))."""
    a, b = emb[0::2], emb[1::2]
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    lab = labels[0::2]
    diff = tau * (cos[:, None] - cos[None, :])
    ordered = diff[lab[:, None] < lab[None, :]]
    return torch.logsumexp(torch.cat([diff.new_zeros(1), ordered]), dim=0)


gen = torch.Generator().manual_seed(20260521)
n_pairs, dim, tau = 24, 32, 20.0
labels = torch.rand(n_pairs, generator=gen, dtype=torch.float64).repeat_interleave(2)
emb = torch.randn(2 * n_pairs, dim, generator=gen, dtype=torch.float64)
emb_ref = emb.clone().requires_grad_(True)
emb_ours = emb.clone().requires_grad_(True)
ref = cosent_reference(labels, emb_ref, tau)
ours = angle_kernels.cosine_loss(labels, emb_ours, tau, backend="torch")
ref.backward()
ours.backward()
value_err = abs(float(ours.detach()) - float(ref.detach())) / abs(float(ref.detach()))
grad_err = float((emb_ours.grad - emb_ref.grad).norm() / emb_ref.grad.norm())
assert value_err < 1e-10 and grad_err < 1e-8, f"cosine_loss: value rel err {value_err:.3e}, grad rel err {grad_err:.3e}"
print(f"OK angle_kernels {angle_kernels.__version__} from {os.path.dirname(location)} | torch {torch.__version__} "
      f"| cosine_loss {float(ours.detach()):.6f} (rel err {value_err:.1e}, grad {grad_err:.1e})")
'''


# Appended to INSTALLED_PACKAGE_CHECK to run pip's console scripts (argv[3:]) with --help in the same interpreter,
# as `python SCRIPT --help` runs them (as __main__, argv[0] the script): one start of torch instead of one per script.
CONSOLE_SCRIPTS_HELP = r'''
import contextlib
import io
import runpy

for script in sys.argv[3:]:
    sys.argv = [script, "--help"]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            assert exc.code in (0, None), f"{script} --help exited with {exc.code}"
        else:
            raise AssertionError(f"{script} --help did not exit")
    name = os.path.basename(script)
    assert shown.getvalue().startswith(f"usage: {name}"), shown.getvalue()[:500]
    print(f"OK {name} --help")
'''


def _source_version() -> str:
    """angle_kernels/_version.py's __version__, read without importing anything."""
    tree = ast.parse((REPO / "angle_kernels" / "_version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("angle_kernels/_version.py defines no __version__")


def _run(cmd: list, timeout: int, **kwargs) -> subprocess.CompletedProcess:
    """Run a command, failing the test with its output when it fails or times out."""
    shown = " ".join("<script>" if len(str(arg)) > 200 else str(arg) for arg in cmd)  # not the whole -c script
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"timed out after {timeout} s: {shown}\n{exc.stdout or ''}\n{exc.stderr or ''}")
    assert proc.returncode == 0, (
        f"exit {proc.returncode}: {shown}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


def _source_files(root: Path, package: str) -> set:
    """Every .py file of a package in a source tree, as archive-style relative paths."""
    return {p.relative_to(root).as_posix() for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """(source copy, sdist path, wheel path), built once for the module."""
    work = tmp_path_factory.mktemp("packaging")
    src = work / "src"
    shutil.copytree(REPO, src, ignore=COPY_IGNORE)
    for junk in PLANTED_JUNK:
        (src / junk).parent.mkdir(parents=True, exist_ok=True)
        (src / junk).write_bytes(b"junk")
    out = work / "dist"
    env = {**os.environ, "ANGLE_KERNELS_BUILD_CUDA": "0"}
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
         BUILD_TIMEOUT_S, cwd=work, env=env)
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, f"expected one sdist and one wheel, got {os.listdir(out)}"
    return src, sdists[0], wheels[0]


@pytest.fixture(scope="module")
def wheel_names(dists):
    with zipfile.ZipFile(dists[2]) as wheel:
        return set(wheel.namelist())


def _assert_no_junk(names: set, what: str) -> None:
    junk = sorted(n for n in names if n.startswith((".venv/", "venv/", ".git/", "build/", "dist/", "tests/", "bench/"))
                  or "__pycache__" in n or n.endswith((".pyc", ".pyo", ".so", ".o")))
    assert not junk, f"{what} carries files it must not: {junk}"


def test_sdist_has_sources_docs_and_csrc_and_no_junk(dists):
    src, sdist, _ = dists
    version = _source_version()
    assert sdist.name == f"angle_kernels-{version}.tar.gz"
    prefix = f"angle_kernels-{version}/"
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
        pkg_info = archive.extractfile(prefix + "PKG-INFO").read().decode()
    assert all(m == prefix.rstrip("/") or m.startswith(prefix) for m in members), "members outside the top folder"
    names = {m[len(prefix):] for m in members if m.startswith(prefix)}

    missing = [f for f in TOP_LEVEL_FILES if f not in names]
    assert not missing, f"sdist lacks {missing}"
    csrc = {p.relative_to(src).as_posix() for p in (src / "csrc").iterdir() if p.suffix in CSRC_SUFFIXES}
    assert csrc, "the checkout has no csrc/ sources to check"
    assert csrc <= names, f"sdist lacks CUDA sources {sorted(csrc - names)}"
    for package in PACKAGES:
        expected = _source_files(src, package)
        assert expected <= names, f"sdist lacks {sorted(expected - names)}"
    _assert_no_junk(names, "the sdist")
    assert email.parser.Parser().parsestr(pkg_info)["Version"] == version


def test_wheel_has_every_package_and_no_junk(dists, wheel_names):
    src, _, wheel = dists
    version = _source_version()
    # Built with ANGLE_KERNELS_BUILD_CUDA=0: pure Python, one wheel for every platform.
    assert wheel.name == f"angle_kernels-{version}-py3-none-any.whl"
    subpackages = list(REQUIRED_SUBPACKAGES) + [p for p in OPTIONAL_SUBPACKAGES if (src / p).is_dir()]
    for subpackage in subpackages:
        assert f"{subpackage}/__init__.py" in wheel_names, f"the wheel lacks the subpackage {subpackage}"
    for package in PACKAGES:
        expected = _source_files(src, package)
        assert expected <= wheel_names, f"the wheel lacks {sorted(expected - wheel_names)}"
    top_level = {n.split("/")[0] for n in wheel_names}
    assert top_level == {*PACKAGES, f"angle_kernels-{version}.dist-info"}, f"unexpected top-level entries {top_level}"
    _assert_no_junk(wheel_names, "the wheel")


def test_wheel_metadata_and_entry_point(dists, wheel_names):
    _, _, wheel = dists
    version = _source_version()
    dist_info = f"angle_kernels-{version}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        metadata = email.parser.Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(f"{dist_info}/entry_points.txt").decode())
    assert metadata["Name"] == "angle-kernels"
    assert metadata["Version"] == version, "the wheel's version is not angle_kernels/_version.py's"
    assert set(EXTRAS) <= set(metadata.get_all("Provides-Extra") or []), metadata.get_all("Provides-Extra")
    requires = metadata.get_all("Requires-Dist") or []
    torch_reqs = [r for r in requires if re.match(r"torch\b", r)]
    assert torch_reqs and all("+" not in r for r in torch_reqs), f"torch requirement {torch_reqs} (no local build)"
    for extra in EXTRAS:
        assert any(f'extra == "{extra}"' in r for r in requires), f"the [{extra}] extra requires nothing"
    assert any(r.startswith("transformers") and 'extra == "train"' in r for r in requires), requires
    assert f"{dist_info}/licenses/LICENSE" in wheel_names
    assert entry_points["console_scripts"]["angle-train"].strip() == "angle_train.cli:main"
    assert entry_points["console_scripts"]["angle-eval"].strip() == "angle_train.evaluate:main"


def test_wheel_installs_with_pip_and_computes_a_loss(dists, tmp_path):
    _, _, wheel = dists
    version = _source_version()
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
          "--target", str(target), str(wheel)], PIP_TIMEOUT_S)
    # --no-deps: only our two packages, their metadata and the console script; torch comes from this environment.
    installed = {p.name for p in target.iterdir()}
    assert installed == {*PACKAGES, f"angle_kernels-{version}.dist-info", "bin"}, installed

    # PYTHONPATH puts the install dir ahead of site-packages; cwd is elsewhere so the checkout is not importable.
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("PYTHONHOME", None)
    scripts = [target / "bin" / name for name in ("angle-train", "angle-eval")]
    assert all(script.is_file() for script in scripts), f"pip installed {os.listdir(target / 'bin')}"
    proc = _run([sys.executable, "-c", INSTALLED_PACKAGE_CHECK + CONSOLE_SCRIPTS_HELP, str(target), version,
                 *map(str, scripts)], RUN_TIMEOUT_S, cwd=tmp_path, env=env)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("OK angle_kernels"), proc.stdout
    assert lines[1:] == ["OK angle-train --help", "OK angle-eval --help"], proc.stdout


@pytest.mark.skipif(os.environ.get("ANGLE_KERNELS_TEST_FRESH_VENV") != "1",
                    reason="slow (minutes) and needs the package index: set ANGLE_KERNELS_TEST_FRESH_VENV=1")
def test_wheel_installs_into_a_fresh_venv_without_changing_torch(dists, tmp_path):
    """A new venv: torch first (this environment's version, so never a surprise CUDA build), then the wheel
    with the [train] extra under a constraint that keeps that torch; the package then works from there."""
    import torch

    _, _, wheel = dists
    version = _source_version()
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], RUN_TIMEOUT_S)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    constraint = tmp_path / "torch-constraint.txt"
    constraint.write_text(f"torch=={torch.__version__}\n")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraint)]
    _run([*pip, f"torch=={torch.__version__.split('+')[0]}"], FRESH_VENV_PIP_TIMEOUT_S)

    def venv_torch_version() -> str:
        return _run([str(python), "-c", "import torch; print(torch.__version__)"], RUN_TIMEOUT_S).stdout.strip()

    torch_before = venv_torch_version()
    assert torch_before == torch.__version__
    _run([*pip, f"angle-kernels[train] @ {wheel.as_uri()}"], FRESH_VENV_PIP_TIMEOUT_S)
    assert venv_torch_version() == torch_before, "installing the wheel changed torch"

    site_packages = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         RUN_TIMEOUT_S).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    proc = _run([str(python), "-c", INSTALLED_PACKAGE_CHECK, site_packages, version], RUN_TIMEOUT_S,
                cwd=tmp_path, env=env)
    assert proc.stdout.startswith("OK angle_kernels"), proc.stdout
    help_run = _run([str(bin_dir / "angle-train"), "--help"], RUN_TIMEOUT_S, cwd=tmp_path, env=env)
    assert help_run.stdout.startswith("usage: angle-train"), help_run.stdout[:500]


def _run_the_sentence_transformers_integration_afresh() -> None:
    """The integration module's file, run in this process as a fresh module object that sys.modules never holds (no
    second interpreter re-importing torch)."""
    import angle_kernels.integrations

    name = "angle_kernels.integrations.sentence_transformers"
    spec = importlib.util.spec_from_file_location(
        name, Path(angle_kernels.integrations.__file__).with_name("sentence_transformers.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_the_sentence_transformers_integration_says_what_to_install(monkeypatch):
    """Imported without sentence-transformers, the integration raised a bare "No module named
    'sentence_transformers'"; it names the package and the version to install (as the angle-emb integration does).
    find_spec does not find sentence-transformers, as the import check asks."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args, **kwargs: None
                        if name == "sentence_transformers" else real_find_spec(name, *args, **kwargs))
    with pytest.raises(ModuleNotFoundError) as raised:
        _run_the_sentence_transformers_integration_afresh()
    assert "pip install 'sentence-transformers>=5.7'" in str(raised.value), raised.value


@pytest.mark.parametrize("version", ["5.6.0", "5.1.2", "4.1.0"])
def test_the_sentence_transformers_integration_refuses_a_release_too_old_for_it(monkeypatch, version):
    """Under sentence-transformers older than 5.7 the drop-ins imported and failed at the first training step (the
    parent MatryoshkaLoss has no uses_gradient_cache, AdaptiveLayerLoss takes no layer_weighting, the model has no
    preprocess); the import now says which release is installed and what to install."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    monkeypatch.setattr(sentence_transformers, "__version__", version)
    with pytest.raises(ImportError, match=rf"from release 5\.7 on; {re.escape(version)} is installed: "
                                          r"pip install 'sentence-transformers>=5\.7'"):
        _run_the_sentence_transformers_integration_afresh()
    monkeypatch.setattr(sentence_transformers, "__version__", "5.7.0.dev0")  # the oldest release taken
    _run_the_sentence_transformers_integration_afresh()


@pytest.mark.parametrize("version, release", [("6.3.0", (6, 3)), ("6.3.0.dev0", (6, 3)), ("6.3.0rc1", (6, 3)),
                                              ("6.4.0+local", (6, 4)), ("6.10.1", (6, 10)), ("1!6.3.0", (6, 3)),
                                              ("6rc3", (6, 0)), ("6.2.1.post2+cu121.7", (6, 2)),
                                              ("6.3.0.custom", (6, 3))])
def test_the_sentence_transformers_release_is_read_by_pep_440(version, release):
    """The release the drop-ins follow (its oldest taken, GIST's self-negatives before 6.3) as PEP 440 reads it: the
    string's first two numbers took an epoch for the major release, refusing "1!6.3.0" as 1.6, and a pre-release's
    number for the minor one, "6rc3" as 6.3, which left out GIST's self-negatives that 6.0 has."""
    ours = pytest.importorskip("angle_kernels.integrations.sentence_transformers")
    assert ours._release(version) == release


def test_shipped_files_cite_no_path_outside_the_repository():
    """What a clone or the package holds (the packages, READMEs, docs, scripts) names no file outside the
    repository: a reader of a clone has no `../shared` (its data and guides are named by their public sources)."""
    shipped = [REPO / "README.md", REPO / "angle_train" / "README.md", REPO / "CHANGELOG.md"]
    for folder in ("angle_kernels", "angle_train", "docs", "scripts"):
        shipped += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    citing = [str(p.relative_to(REPO)) for p in shipped if re.search(r"shared/(docs|data)", p.read_text())]
    assert not citing, f"files naming ../shared: {citing}"
