"""Reading a config file: YAML that refuses a repeated key and an alias bomb."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml


# A real config has a few hundred values; YAML aliases can make a few hundred bytes expand to billions
# (an "anchor bomb": each level of aliases multiplies the values every later pass has to walk).
MAX_CONFIG_VALUES = 100_000


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing a mapping that repeats a key: PyYAML keeps the last one silently, so a second
    `trainer:` block appended to a config would replace the first one whole. A repeated merge key (`<<: *a` twice)
    is refused too, and so is a repeat inside an inline mapping merged in (`<<: {lr: 1, lr: 2}`), which PyYAML
    merges without ever constructing it."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()  # id() of the mappings checked (the nodes live as long as the loader)

    def flatten_mapping(self, node):
        # Called on every mapping before its merge keys are expanded, and on each mapping merged in. Once expanded,
        # a mapping holds its own keys after the merged ones (an override, not a repeat): checked only once.
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen, merges = set(), 0
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    merges += 1
                    if merges > 1:
                        raise yaml.constructor.ConstructorError(None, None, "the merge key << appears twice in one "
                                                                "mapping (merge several: <<: [*a, *b])", key_node.start_mark)
                    continue
                key = self.construct_object(key_node)
                if not isinstance(key, typing.Hashable):
                    continue  # SafeLoader refuses it with its own message
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} appears twice in one mapping",
                                                            key_node.start_mark)
                seen.add(key)
        super().flatten_mapping(node)


def read_yaml(path: str | Path) -> Any:
    """The YAML document of `path` (yaml.safe_load, refusing a repeated key). Raises OSError, UnicodeDecodeError,
    yaml.YAMLError (a repeated key: ConstructorError), or ValueError when its aliases expand it past
    MAX_CONFIG_VALUES values (counted without expanding: the walk stops at the cap, a self-referencing alias
    included) or it nests deeper than PyYAML's recursive parser can follow."""
    text = Path(path).read_text()
    try:
        loader = _UniqueKeyLoader(text)  # what yaml.safe_load does, with the repeated-key check
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except RecursionError:  # `[[[[...` a few thousand deep: a RuntimeError, outside every caller's one-line path
        raise ValueError("the document nests deeper than a YAML parser follows (thousands of [ or {?): refused") from None
    count, stack = 0, [data]
    while stack:
        value = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ValueError(f"the document expands to more than {MAX_CONFIG_VALUES} values (YAML aliases?): refused")
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return data
