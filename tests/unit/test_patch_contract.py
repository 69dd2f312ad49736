"""The contract every patch keeps (``qurl_verl/patches/contract.py``): a record, a place in its group's
order, a docstring that says what it targets and why, a test, and ``Patch.apply``'s own rules."""
from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest

from qurl_verl.patches import contract
from qurl_verl.patches.contract import Patch, wrap_once

PATCHES = Path(contract.__file__).parent
TESTS = Path(__file__).resolve().parents[1]
GROUPS = sorted(p.name for p in PATCHES.iterdir() if (p / "__init__.py").exists())


def group_modules(group: str) -> list[str]:
    return sorted(p.stem for p in (PATCHES / group).glob("*.py") if p.name != "__init__.py")


def test_the_groups_are_the_ones_the_package_documents():
    assert GROUPS == ["always", "cpu_platform", "install", "qurl_vllm", "qurl_vllm_server", "vllm_cpu_worker", "vllm_worker"]


@pytest.mark.parametrize("group", GROUPS)
def test_each_group_orders_every_patch_of_its_folder(group):
    package = importlib.import_module(f"qurl_verl.patches.{group}")
    assert sorted(package.ORDER) == group_modules(group)
    assert len(set(package.ORDER)) == len(package.ORDER)


@pytest.mark.parametrize("name", [f"{g}.{m}" for g in GROUPS for m in group_modules(g)])
def test_each_patch_declares_its_record_and_says_what_it_targets(name):
    module = importlib.import_module(f"qurl_verl.patches.{name}")
    record = module.PATCH
    assert isinstance(record, Patch) and record.module == module.__name__
    upstream, _, qualname = record.target.partition(":")
    assert upstream and qualname, record.target  # module:qualname
    assert record.versions and all(record.versions) and record.when and record.package
    doc = module.__doc__ or ""
    assert "Targets:" in doc or "Targets " in doc or record.package in doc, name
    assert "Why" in doc, name
    tested = [p for p in TESTS.rglob("*.py") if record.name in p.read_text() and p != Path(__file__).resolve()]
    assert tested, f"no test names {record.name}"


def record(change, applies=None, versions=("0.0.1",)) -> Patch:
    return Patch(module="qurl_verl.patches.test_only", target="json:dumps", package="pytest", versions=versions,
                 when="in this test", change=change, applies=applies)


def test_apply_runs_the_change_only_where_it_applies():
    calls = []
    off = record(lambda: calls.append(1) or "done", applies=lambda: False)
    assert off.apply() == "" and calls == []
    assert record(lambda: "done", applies=lambda: True).apply() == "done"


def test_a_patch_that_acts_on_a_version_it_was_not_written_for_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(contract, "_warned", set())
    untargeted = record(lambda: "done")  # pytest is installed, and not at 0.0.1
    with caplog.at_level(logging.WARNING, logger="qurl_verl"):
        untargeted.apply()
        untargeted.apply()
        record(lambda: "", versions=("0.0.1",)).apply()  # did nothing: no warning either way
    assert [r.getMessage() for r in caplog.records].count(
        f"qurl-verl: qurl_verl.patches.test_only written for pytest 0.0.1, running on {pytest.__version__}") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qurl_verl"):
        monkeypatch.setattr(contract, "_warned", set())
        record(lambda: "done", versions=(pytest.__version__,)).apply()
    assert not caplog.records


def test_wrap_once_wraps_once_and_leaves_absent_names_alone():
    class Owner:
        @staticmethod
        def f(x):
            return x + 1

    def add_ten(original):
        return lambda x: original(x) + 10

    assert wrap_once(Owner, "f", add_ten, "_mark") == "wrapped Owner.f"
    assert wrap_once(Owner, "f", add_ten, "_mark") == ""
    assert Owner.f(1) == 12
    assert wrap_once(Owner, "missing", add_ten, "_mark") == ""
