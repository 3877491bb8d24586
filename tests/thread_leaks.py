"""Pytest plugin (loaded by tests/conftest.py): no test may leave a thread running.

Every ``threading.Thread`` started while the suite runs is tagged with an *owner*:

- a thread started by the main thread belongs to whatever pytest is running at that moment: the
  test (its setup, call and teardown, function-scoped fixtures included), or the module-, class-,
  package- or session-scoped fixture being set up, or "the session" (collection, imports);
- a thread started by another thread belongs to the owner of that thread (so the pool threads a
  gRPC server spawns on its first request belong to whoever started the server, not to the test
  that sent the request).

A test's threads must have ended by the end of its teardown (else: an error at the teardown of that
test, naming it and the threads). A wider-scoped fixture's threads must have ended once its scope
ends: they are checked after the teardown of the test during which the fixture was finalized,
together with every other fixture finalized then (a module-scoped fixture may start what another
module-scoped fixture stops, as ``golden_scrape`` does with ``start_exporter_app_module``), and
reported as a teardown error of that test naming the fixture. Whatever is still running when the
session ends (threads started at import or collection time, threads of a test whose teardown
already failed) makes the session fail. Each check gives the threads a short grace period (joined
for up to ``GRACE_SECONDS`` in total), so a thread that is just finishing does not flake.

Exceptions (``EXEMPT``) are only for threads that a library keeps process-wide by design and that
no public API stops; each must be justified where it is listed. There are none today: the gRPC,
OpenTelemetry SDK and http.server threads the suite starts all end when what started them is
stopped (see ``_GrpcServer`` in otel_dra/plugin/server.py for the gRPC thread pools).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from dataclasses import dataclass

import pytest

GRACE_SECONDS = 2.0


@dataclass(frozen=True, eq=False)
class Owner:
    """Who is accountable for a thread: a test, a wider-scoped fixture, or the session."""

    label: str


SESSION = Owner("the test session (collection, imports, hooks outside any test)")

# What the main thread is running now; the innermost entry owns the threads it starts.
_context: list[Owner] = []
# The owner of each wider-scoped fixture currently set up, by its FixtureDef.
_fixture_owners: dict[object, Owner] = {}
# Wider-scoped fixtures finalized since the last check: checked after the current test's teardown.
_finalized: list[Owner] = []
# The session-end leftovers, for the terminal summary.
_session_leftovers: list[threading.Thread] = []

_ATTR = "_otel_dra_test_owner"
_original_start = threading.Thread.start


def _owner_for_new_thread() -> Owner:
    current = threading.current_thread()
    if current is threading.main_thread():
        return _context[-1] if _context else SESSION
    owner = getattr(current, _ATTR, None)
    return owner if isinstance(owner, Owner) else SESSION


def _tracked_start(self: threading.Thread) -> None:
    setattr(self, _ATTR, _owner_for_new_thread())
    _original_start(self)


threading.Thread.start = _tracked_start  # type: ignore[method-assign]


# Name prefixes of threads a library keeps for the whole process by design, each with its reason.
EXEMPT: tuple[str, ...] = ()


def _exempt(thread: threading.Thread) -> bool:
    return thread.name.startswith(EXEMPT) if EXEMPT else False


def leftover_threads(owner: Owner | None, grace: float = GRACE_SECONDS) -> list[threading.Thread]:
    """The live threads owned by ``owner`` (all tracked threads when None) after joining them for
    up to ``grace`` seconds in total."""

    def alive() -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t is not threading.main_thread()
            and t is not threading.current_thread()
            and hasattr(t, _ATTR)
            and (owner is None or getattr(t, _ATTR) is owner)
            and not _exempt(t)
        ]

    deadline = time.monotonic() + grace
    for thread in alive():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        thread.join(remaining)
    return alive()


def describe(threads: list[threading.Thread]) -> str:
    return ", ".join(f"{t.name!r}{' (daemon)' if t.daemon else ''}" for t in threads)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    _context.append(Owner(f"test {item.nodeid}"))
    try:
        return (yield)
    finally:
        _context.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    # A teardown that fails is reported as it is; its threads, if left, fail the session at its end.
    yield
    problems = []
    owner = _context[-1] if _context else None
    if owner is not None and (leftovers := leftover_threads(owner)):
        problems.append(
            f"{item.nodeid} left {len(leftovers)} thread(s) running after its teardown: {describe(leftovers)}. "
            "Stop/close/join what the test starts."
        )
    finalized, _finalized[:] = _finalized[:], []
    for fixture in finalized:
        if leftovers := leftover_threads(fixture):
            problems.append(
                f"{fixture.label} left {len(leftovers)} thread(s) running after its teardown: {describe(leftovers)}. "
                "Stop/close/join what the fixture starts."
            )
    if problems:
        pytest.fail("\n".join(problems) + f"\n(each waited for up to {GRACE_SECONDS:g}s)", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[object]) -> Generator[None, object, object]:
    if fixturedef.scope == "function":
        # Its threads are the test's: checked after the test's teardown.
        return (yield)
    owner = Owner(f"fixture {fixturedef.argname!r} ({fixturedef.scope}-scoped, {fixturedef.baseid or 'conftest'})")
    _fixture_owners[fixturedef] = owner
    _context.append(owner)
    try:
        return (yield)
    finally:
        _context.pop()


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[object]) -> None:
    """Runs after a fixture's teardown: its threads are checked after the current test's teardown."""
    owner = _fixture_owners.pop(fixturedef, None)
    if owner is not None:
        _finalized.append(owner)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Every fixture is torn down by now: any tracked thread still running fails the session."""
    _session_leftovers[:] = leftover_threads(None)
    if _session_leftovers and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _session_leftovers:
        return
    terminalreporter.section("threads left running", sep="=", red=True, bold=True)
    for thread in _session_leftovers:
        terminalreporter.write_line(f"{describe([thread])}, started by {getattr(thread, _ATTR).label}")
    terminalreporter.write_line(
        f"{len(_session_leftovers)} thread(s) still running at the end of the session: failing it."
    )
