"""Collecting each property test's result into the session, for the certificate: the
record a property attached to its report, or one made from the report when the test
never got to make one (its process crashed, a fixture failed, a marker skipped it).

``conformance.plugin`` registers :class:`_ResultCollector` as a plugin of the run.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from conformance.harness.ordering import LEVEL_ORDER
from conformance.harness.session import Session, Subject

__all__: list[str] = []


def _target_of(item: pytest.Item) -> Any:
    return getattr(getattr(item, "callspec", None), "params", {}).get("target")


def _label_of(item: pytest.Item) -> str | None:
    return getattr(_target_of(item), "label", None)


#: A property test's node id: ``::test_<property>[<label>-]<level>-<dtype>-<device>]``,
#: every level (a flash, varlen or kvcache test unmatched here escaped --impl-exitfirst
#: and, crashed or skipped at setup, the certificate).
_NODE_ID = re.compile(r"::test_(?P<property>\w+)\[(?:(?P<label>.+)-)?(?P<level>" + "|".join(LEVEL_ORDER)
                      + r")-(?P<dtype>\w+)-(?P<device>\w+)\]$")


class _ResultCollector:
    """Gathers the records attached to test reports into the session: under
    xdist the controller receives every worker's reports here. A property test
    whose report carries no record (its process crashed, a fixture failed, a
    marker skipped it) gets one made from the report, so that the certificate
    counts every test pytest counts."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def _subject(self, nodeid: str) -> Subject | None:
        """The implementation a property test's node id names (None: not a property test)."""
        m = _NODE_ID.search(nodeid)
        return None if m is None else self.session.subjects.get(m["label"] or "")

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        from conformance.isolation import supervisor as isolation

        subject = self._subject(item.nodeid)
        isolation.mark_running(subject.impl_spec if subject else self.session.impl_spec, item.nodeid)
        if subject is not None and self.session.exitfirst and subject.stopped_by:
            pytest.skip(f"--impl-exitfirst: {subject.impl_spec} already failed {subject.stopped_by}")

    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """After an implementation's last test, its isolated worker (if any) stops."""
        if not self.session.compares:
            return
        label = _label_of(item)
        subject = self.session.subjects.get(label or "")
        if subject is not None and subject.isolation is not None and (
                nextitem is None or _label_of(nextitem) != label):
            subject.isolation.close()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and self.session.exitfirst:
            subject = self._subject(report.nodeid)
            if subject is not None and not subject.stopped_by:
                subject.stopped_by = report.nodeid.rsplit("::", 1)[-1]
        recorded = False
        for key, value in getattr(report, "user_properties", ()):
            if key == "conformance":
                self.session.results.append(value)
                recorded = True
        if recorded:
            self.session.recorded.add(report.nodeid)
        elif report.nodeid not in self.session.recorded and (
                report.failed or (report.skipped and report.when == "setup")):
            result = self._result_from_report(report)
            if result is not None:
                self.session.results.append(result)
                self.session.recorded.add(report.nodeid)

    def _result_from_report(self, report: pytest.TestReport) -> dict[str, Any] | None:
        from conformance.core.registry import Record, registered_properties
        from conformance.isolation import supervisor as isolation

        m = _NODE_ID.search(report.nodeid)
        if m is None or m["property"] not in registered_properties():
            return None
        record = Record(m["property"], m["level"], m["dtype"], m["device"])
        subject = self.session.subjects.get(m["label"] or "")
        spec = subject.impl_spec if subject is not None else self.session.impl_spec
        text = str(getattr(report, "longreprtext", "") or report.longrepr or "").strip()
        if report.skipped and isinstance(report.longrepr, tuple):  # (path, line, "Skipped: why")
            text = str(report.longrepr[2])
        if report.skipped:
            record.outcome = "skipped"
            record.reason = text.rsplit("Skipped: ", 1)[-1] if "Skipped: " in text else text
        elif "crashed while running" in text:
            record.outcome = "failed"
            record.message = (
                f"{text.splitlines()[-1]}: the test process died (os._exit, abort or a segfault in "
                "the implementation?) before the property could save the case; rerun with "
                "--isolate=always to run the implementation in a worker process that survives it"
            )
            isolation.record_crash(spec, f"a test process died during {report.nodeid}")
        else:
            record.outcome = "failed" if report.when == "call" else "error"
            record.message = f"{report.when} of the test failed outside the property: " + text[-2000:]
        result = record.as_dict()
        if self.session.compares:
            result["implementation"] = m["label"]
        return result
