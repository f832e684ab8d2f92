"""Print pip constraints that pin every dependency of pagellm to its declared floor.

CI's second leg installs with these constraints, so the floors in pyproject.toml are the
versions that leg tests: one source, no list to keep in step by hand. Every requirement
must carry a `>=` floor (a dependency without one has no tested lower bound).

torch is the one exception: the only CPU build CI can install without pulling several GB
of CUDA libraries is the wheel on the machine's disk (OVERRIDES); the torch floor itself
is checked by hand on the CUDA wheel running on the CPU (README, "Dependencies").
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("serve", "bench", "compat", "test")
OVERRIDES = {"torch": "2.13.0"}
# name, optional [extras] (pip constraints take none: the pin is on the name), floor.
REQUIREMENT = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[A-Za-z0-9._,-]+\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*$")


def floors(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """name -> floor for the dependencies and the EXTRAS; raises on a requirement
    that is not a plain `name>=version` or `name[extras]>=version` (an upper cap or a
    missing floor)."""
    import tomllib  # Python 3.11+: CI's interpreter (3.10's stdlib has none)

    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in EXTRAS:
        requirements += project["optional-dependencies"][extra]
    result: dict[str, str] = {}
    for requirement in requirements:
        match = REQUIREMENT.match(requirement)
        if match is None:
            raise ValueError(f"{requirement!r}: expected 'name>=floor' (no cap, no marker)")
        name, version = match.group(1).lower(), match.group(2)
        if result.setdefault(name, version) != version:
            raise ValueError(f"{name}: two floors, {result[name]} and {version}")
    return result


def main() -> int:
    for name, version in sorted(floors().items()):
        print(f"{name}=={OVERRIDES.get(name, version)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
