"""String options with a fixed set of values (feature sets, eviction modes), parsed with a one-line error."""

from __future__ import annotations

import re
from enum import Enum
from typing import TypeVar

ChoiceT = TypeVar("ChoiceT", bound="Choice")


class Choice(str, Enum):
    """Base of the project's string enums: `parse` names the option (from the class name) and
    lists the allowed values when a value is unknown."""

    @classmethod
    def parse(cls: type[ChoiceT], value: str | ChoiceT) -> ChoiceT:
        try:
            return cls(value)
        except ValueError:
            label = re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()
            allowed = ", ".join(repr(member.value) for member in cls)
            raise ValueError(f"unknown {label} {value!r}; allowed: {allowed}") from None
