"""What every config section shares: unknown keys, non-finite floats and a boolean where a number belongs are refused."""

from __future__ import annotations

import json
import types
import typing
from typing import Annotated

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _alternatives(annotation) -> list:
    """`annotation`'s alternatives: Optional, Union and Annotated unwrapped (list[int] and Literal[...] kept whole)."""
    out, stack = [], [annotation]
    while stack:
        t = stack.pop()
        origin = typing.get_origin(t)
        if origin is Annotated:
            stack.append(typing.get_args(t)[0])
        elif origin in (typing.Union, types.UnionType):
            stack.extend(typing.get_args(t))
        else:
            out.append(t)
    return out


def _bool_for_a_number(annotation, value) -> bool:
    """True when `value` is a bool where `annotation` takes an int or a float but not a bool (pydantic would read
    true as 1), or a list or dict holding one where the annotation's items do (`stop_token_ids: [true, 2]`)."""
    kinds = _alternatives(annotation)
    if isinstance(value, bool):
        return any(k in (int, float) for k in kinds) and bool not in kinds
    if not isinstance(value, (list, dict)):
        return False
    # list[X] -> X, dict[K, X] -> X: what each of the value's items must be
    items = [typing.get_args(k)[-1] for k in kinds if typing.get_origin(k) is type(value) and typing.get_args(k)]
    return bool(items) and any(all(_bool_for_a_number(t, v) for t in items)
                               for v in (value if isinstance(value, list) else value.values()))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value, info: ValidationInfo):
        if _bool_for_a_number(cls.model_fields[info.field_name].annotation, value):
            got = json.dumps(value) if isinstance(value, bool) else f"a boolean in {json.dumps(value, default=str)[:80]}"
            raise ValueError(f"expects a number, got {got} (YAML reads true/false/yes/no/on/off as booleans)")
        return value
