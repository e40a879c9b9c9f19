"""The suite's tiers (tests/conftest.py): a unit test over the limit fails and says what to do; a test
marked integration or e2e may take longer; a test that fails on its own keeps its own failure."""

from __future__ import annotations

import pytest

INNER = """
import time

import pytest


def test_slow_unit():
    time.sleep(0.5)


@pytest.mark.integration
def test_slow_integration():
    time.sleep(0.5)


@pytest.mark.e2e
def test_slow_e2e():
    time.sleep(0.5)


def test_fast_unit():
    pass


def test_failing_slow_unit():
    time.sleep(0.5)
    assert 1 == 2
"""


INNER_CONFTEST = """
import os

from tests.conftest import pytest_runtest_makereport  # noqa: F401


def pytest_configure(config):
    os.environ["BASIN_UNIT_LIMIT_S"] = "0.2"  # the inner run's limit only


def pytest_unconfigure(config):
    del os.environ["BASIN_UNIT_LIMIT_S"]
"""


def test_a_unit_test_over_the_limit_fails_naming_it_and_the_tiers_are_exempt(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    integration: long\n"
                     "    e2e: through the router\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(["*test_slow_unit: a unit test ran 0.5 s, over the unit tier's 0.2 s: make it "
                                 "faster, or mark it integration*"])
    assert "assert 1 == 2" in result.stdout.str()  # its own failure, not the limit's
    assert "test_failing_slow_unit: a unit test ran" not in result.stdout.str()


def test_the_unit_limit_stretches_only_with_a_load_over_the_cores() -> None:
    from tests.conftest import unit_limit_s

    assert unit_limit_s(5.0, 0.5, 2) == 5.0
    assert unit_limit_s(5.0, 2.0, 2) == 5.0
    assert unit_limit_s(5.0, 6.0, 2) == 15.0
    assert unit_limit_s(5.0, 3.0, 0) == 15.0  # cpu_count unknown: one core
