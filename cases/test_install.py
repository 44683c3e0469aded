"""The `maxtext` extra and constraints/maxtext.txt, the README's MaxText install, stay in step:
everything MaxText-only is for Python >= 3.12 (so `.[test,maxtext]` still installs on 3.11),
and the constraints pin every package the extra names, tokamax at 0.0.12."""
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PY311 = {"python_version": "3.11", "python_full_version": "3.11.0"}
PY312 = {"python_version": "3.12", "python_full_version": "3.12.0"}


def _extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"]["maxtext"]]


def _constraints():
    lines = (ROOT / "constraints" / "maxtext.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def test_maxtext_extra_is_python_312_only_but_pyyaml():
    on_311 = [r.name for r in _extra() if r.marker is None or r.marker.evaluate(PY311)]
    assert on_311 == ["pyyaml"]
    assert {"maxtext", "flax", "tokamax", "jax"} <= {r.name for r in _extra()
                                                      if r.marker and r.marker.evaluate(PY312)}


def test_constraints_pin_the_extra_for_python_312_only():
    pins = {canonicalize_name(r.name): r for r in _constraints()}
    for r in pins.values():
        assert len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==", r
        assert r.marker and r.marker.evaluate(PY312) and not r.marker.evaluate(PY311), r
    for r in _extra():
        assert canonicalize_name(r.name) in pins, f"{r.name} is not pinned"
        assert r.specifier.contains(next(iter(pins[canonicalize_name(r.name)].specifier)).version)
    assert str(pins["tokamax"].specifier) == "==0.0.12"
    assert str(pins["maxtext"].specifier) == "==0.2.5"
