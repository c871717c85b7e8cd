"""scripts/constraints.txt, the lock scripts/setup.sh installs under (pip's -c): it pins every requirement of the
package and its extras to one version, leaves out the three packages setup.sh pins itself, every install in
setup.sh applies it, and the environment the suite runs in is the one it locks. Without it a fresh machine takes
the newest release of everything, and a release made since the suite last passed can turn it red (docs/
reference-packages.md: sentence-transformers 6.3.0 did). scripts/lock_dependencies.sh rewrites it."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "scripts" / "constraints.txt"
SETUP = REPO / "scripts" / "setup.sh"
PINNED_BY_SETUP = {"torch", "sentence-transformers", "angle-emb"}  # TORCH_SPEC, SENTENCE_TRANSFORMERS_SPEC, ==0.6.1


def locked() -> dict[str, str]:
    """The lock's packages (canonical names) and their versions; every line that is not a comment is `name==version`."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version.strip() and " " not in line, f"{LOCK.name}: {line!r} is not name==version"
        pins[canonicalize_name(name)] = version.strip()
    return pins


def requirements() -> list[Requirement]:
    """The package's requirements and those of every extra, as pyproject.toml states them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        texts += extra
    return [Requirement(text) for text in texts]


def test_every_requirement_of_the_package_and_its_extras_is_locked():
    pins = locked()
    missing = sorted({
        requirement.name for requirement in requirements()
        if canonicalize_name(requirement.name) not in PINNED_BY_SETUP | {"angle-kernels"}
        and (requirement.marker is None or requirement.marker.evaluate())
        and canonicalize_name(requirement.name) not in pins})
    assert not missing, f"{LOCK.name} does not lock {missing}: run bash scripts/lock_dependencies.sh"


def test_the_packages_setup_pins_itself_are_left_out():
    assert not PINNED_BY_SETUP & set(locked()), (
        f"{LOCK.name} pins {sorted(PINNED_BY_SETUP & set(locked()))}, which scripts/setup.sh pins itself")


def test_every_install_in_setup_applies_the_lock():
    """Every install command passes the lock: pip's (uv's own install) and the chosen installer's (`"${INSTALL[@]}"`:
    uv, or pip with ANGLE_INSTALLER=pip); the lines that choose the installer are not installs."""
    commands = re.sub(r"\\\n", " ", SETUP.read_text()).splitlines()  # a command continued over lines is one line
    installs = [command for command in commands if not command.lstrip().startswith(("#", "INSTALL=", "pip)"))
                and (re.search(r"\bpip install\b", command) or '"${INSTALL[@]}"' in command)]
    assert len(installs) >= 7
    without = [command for command in installs if '${LOCK[@]+"${LOCK[@]}"}' not in command]
    assert not without, f"{SETUP.name} installs without the lock: {without}"


def test_the_environment_is_the_locked_one():
    """Every locked package installed here has its locked version: what setup.sh installs under the lock."""
    differ = {}
    for name, version in locked().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # one whose marker leaves it out here
        if installed != version:
            differ[name] = f"{installed} installed, {version} locked"
    assert not differ, f"this environment is not the one {LOCK.name} locks (rerun bash scripts/setup.sh): {differ}"
