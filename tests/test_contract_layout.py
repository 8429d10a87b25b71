"""CONTRIBUTING.md's "where to add X" stays true: for each plugin kind the folder it names holds every registered
plugin's module, the config folder it names holds a config per plugin, and the contract test it names exists."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from conftest import REPO
from nats.attention.registry import ATTENTIONS
from nats.cache.registry import CACHES
from nats.data.sources import TEXT_SOURCES

KINDS = {  # registry, plugin folder, config folder, contract test
    "attention": (ATTENTIONS, "nats/attention", "conf/model/attention", "tests/test_contract_attention.py"),
    "cache": (CACHES, "nats/cache/policies", "conf/cache", "tests/test_contract_cache.py"),
    "source": (TEXT_SOURCES, "nats/data/sources", "conf/data", "tests/test_contract_sources.py"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_contributing_names_the_places(kind):
    registry, folder, conf, test = KINDS[kind]
    text = (REPO / "CONTRIBUTING.md").read_text()
    for place in (folder, conf, test):
        assert f"`{place}" in text, f"CONTRIBUTING.md does not name {place}"
    assert (REPO / test).is_file()
    for name in registry.names():
        cls = registry.get(name)
        if not cls.__module__.startswith("nats."):  # registered by a script or a test
            continue
        module = Path(inspect.getfile(cls)).resolve()
        assert module.parent == (REPO / folder).resolve(), f"{kind} {name!r} is defined in {module}, not in {folder}/"
        if kind != "source":  # sources: conf/data/<config>.yaml selects them by `source:` (checked by its contract)
            assert (REPO / conf / f"{name}.yaml").is_file(), f"{kind} {name!r} has no {conf}/{name}.yaml"
