"""Progress of first-run work: shown on a terminal only, and never changing what it tracks."""

from __future__ import annotations

import pytest

from splitllm import progress


@pytest.mark.parametrize("terminal", [False, True])
def test_tracked_work_is_unchanged_with_or_without_a_terminal(monkeypatch: pytest.MonkeyPatch, terminal: bool) -> None:
    monkeypatch.setattr(progress, "_shown", lambda: terminal)
    assert list(progress.tracked(iter(range(5)), "joining", 5)) == list(range(5))
    assert list(progress.tracked([], "nothing")) == []
    with progress.working("building"):
        done = True
    assert done


def test_nothing_is_shown_off_a_terminal(capfd: pytest.CaptureFixture[str]) -> None:
    list(progress.tracked(range(3), "converting", 3))
    with progress.working("building"):
        pass
    assert capfd.readouterr().err == ""
