"""Bad Checkpointer settings fail at construction, as ConfigurationError naming the setting, before any connection."""

from __future__ import annotations

from typing import Any

import pytest

from stowaway import Checkpointer, ConfigurationError

GOOD = {"job": "j", "socket": "/nonexistent/s.sock", "rank": 0, "world_size": 1, "timeout": 1}


@pytest.mark.parametrize(("settings", "message"), [
    ({"job": "bad name!"}, "job name 'bad name!' is invalid: use 1-128 letters"),
    ({"rank": 5, "world_size": 2}, "rank 5 is not within world size 2"),
    ({"slots": 0}, "slots must be between 1 and"),
    ({"timeout": 0}, "timeout must be positive"),
])
def test_a_bad_setting_is_a_configuration_error_that_names_it(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Checkpointer(**{**GOOD, **settings})


def test_a_bad_rank_in_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigurationError, match="environment variable RANK='x' is not an integer"):
        Checkpointer(**{key: value for key, value in GOOD.items() if key != "rank"})
