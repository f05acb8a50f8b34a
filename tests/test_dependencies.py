"""Every dependency is bounded below its next major (or, for a 0.x package, below 1.0), and what this suite runs on
is inside every bound: the suite is the test of the bounds it was run within."""

from __future__ import annotations

import os
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _requirements() -> list[Requirement]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    found += [Requirement(r) for group, reqs in project["optional-dependencies"].items() if group == "dev"
              for r in reqs]
    return found


@pytest.mark.parametrize("req", _requirements(), ids=lambda r: r.name)
def test_a_dependency_has_a_ceiling_and_the_installed_release_is_inside_it(req):
    ceilings = [s for s in req.specifier if s.operator in ("<", "<=")]
    assert ceilings, f"{req}: no upper bound (a next major could break kvscope unseen)"
    installed = Version(metadata.version(req.name))
    assert req.specifier.contains(installed, prereleases=True), f"{req.name} {installed} is outside {req.specifier}"
