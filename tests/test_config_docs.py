"""docs/CONFIG.md is the schema's field docstrings, regenerated and compared (issue 39, point 5).

Every field of ``qwen3_research/config.py``'s schema has an attribute docstring saying what the key does and which
module reads it; ``python -m qwen3_research.config_docs`` writes the reference from them. Two ways to fail: a field
without a docstring (named with its file line and key), and a committed docs/CONFIG.md that differs from what the
command writes now (a docstring, a default or a field changed without regenerating).
"""

from __future__ import annotations

import importlib.util
import sys

from qwen3_research import config, config_docs

# A field planted in a copy of config.py, after TrainingConfig.track_memory's docstring, with no docstring of its own.
PLANT_AFTER = '    """Record the peak live tensor bytes per rank of the second step'
PLANTED = "    new_key: int = 0\n"


def test_every_field_has_a_docstring_and_config_md_is_current():
    """0 fields without a docstring; docs/CONFIG.md equals the generator's output (114 fields in the schema at
    this change, sections included)."""
    keys = config_docs.walk(config.RunConfig)
    missing = config_docs.missing_docstrings()
    print(f"\n{len(keys)} schema fields, {sum(k.nested is None for k in keys)} keys; without a docstring: "
          f"{missing or 'none'}")
    assert missing == []
    assert config_docs.OUT.read_text() == config_docs.render(), (
        f"docs/CONFIG.md is stale: run {config_docs.COMMAND}")
    assert config_docs.main(["--check"]) == 0


def _planted_copy(tmp_path):
    source = config_docs.inspect.getsource(config)
    head, sep, rest = source.partition(PLANT_AFTER)
    assert sep, "TrainingConfig.track_memory's docstring moved: update PLANT_AFTER"
    end = rest.index('"""\n') + 4  # the end of that docstring
    planted = head + sep + rest[:end] + PLANTED + rest[end:]
    path = tmp_path / "planted_config.py"
    path.write_text(planted)
    spec = importlib.util.spec_from_file_location("planted_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["planted_config"] = module  # dataclasses and get_type_hints look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["planted_config"]
        raise
    return module, planted, path


def test_a_field_without_a_docstring_is_named_and_fails(tmp_path):
    """A copy of config.py with one key added without a docstring: the checker names exactly that field, its key
    and its line, and the reference rendered from the copy differs from the committed one (so --check fails)."""
    module, source, path = _planted_copy(tmp_path)
    try:
        missing = config_docs.missing_docstrings(module.RunConfig, source, str(path))
        text = config_docs.render(module.RunConfig, source)
    finally:
        del sys.modules["planted_config"]
    print("\n" + "\n".join(missing))
    line = next(i for i, s in enumerate(source.splitlines(), 1) if s == PLANTED.rstrip("\n"))
    assert missing == [f"{path}:{line}: TrainingConfig.new_key (key training.new_key) has no docstring; add a string "
                       "literal right after the field saying what the key does and which module reads it"]
    assert "| `training.new_key` | `int` | `0` | (no docstring) |" in text
    assert text != config_docs.OUT.read_text()


def test_a_docstring_belongs_to_the_field_right_above_it():
    """A string after a plain statement, or a comment, is not a field's docstring; one right after the field is."""
    src = ('class C:\n    a: int = 1\n    """A."""\n    b: int = 2\n    # b: not a docstring\n    x = 3\n    """X."""\n'
           '    c: int = 3\n')
    docs = config_docs.attribute_docs(src)
    assert docs == {("C", "a"): (2, "A."), ("C", "b"): (4, None), ("C", "c"): (8, None)}
