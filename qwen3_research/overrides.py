"""Command-line overrides read by Hydra's own override grammar: the one place that knows their syntax.

``key=value``, ``+key=value``, ``++key=value``, ``~key[=value]``, ``group=option``, ``group@package=option`` and
sweep values (``a,b``, ``range(…)``, ``choice(…)``, ``interval(…)``, ``glob(…)``) are parsed by
``hydra.core.override_parser`` (the parser ``@hydra.main`` itself uses), never split by hand, so a quoted comma
(``x="a,b"``) or an escaped one (``x=a\\,b``) is one value here as it is for Hydra.

Importing this module is cheap (standard library only): Hydra's parser loads on the first parse. The allocator's
re-exec decision reads ``device=…`` before anything else is imported (``devices.device_kind(argv=…)``, run by every
command), where loading Hydra would cost ~0.3 s a command; it uses ``split_text``, the one reading by text alone,
which also names the parts of a text Hydra refused (``__main__.check_override_syntax``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

# Overrides that do not tell one run of a sweep from another: Hydra's own settings and W&B's mode.
NOT_A_POINT_KEY = ("logging.wandb.mode",)


@dataclass(frozen=True)
class Override:
    """One override as Hydra parsed it."""

    text: str  # as given
    prefix: str  # "", "+", "++" or "~"
    key: str  # the config key or group, with its ``@package`` when one is given; without the prefix
    value: str | None  # as typed (quotes kept); None for ``~key`` without a value
    sweep: bool  # a value a sweeper expands into several runs

    @property
    def head(self) -> str:
        """The text before ``=``: prefix and key (``+training.foo``, ``~model@pkg``)."""
        return self.prefix + self.key


@lru_cache(maxsize=1)
def _parser():
    # deferred: start-up (Hydra's parser is ~0.3 s; split_text's callers run before anything else loads)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


_PREFIX = {"CHANGE": "", "ADD": "+", "FORCE_ADD": "++", "DEL": "~"}


def _ours(o, text: str) -> Override:
    head = o.get_key_element()  # prefix, key and @package exactly as typed: Hydra's keys admit no space and no '='
    value = None if o.value_type is None else text[len(head) + 1:]
    return Override(text, _PREFIX[o.type.name], head[len(_PREFIX[o.type.name]):], value, o.is_sweep_override())


def hydra_parse(texts: Iterable[str]) -> list:
    """Hydra's own ``Override`` objects (``hydra.core.override_parser.types.Override``), for Hydra's sweeper API;
    raises Hydra's ``OverrideParseException`` (its message points at the character) on a text it refuses."""
    return _parser().parse_overrides([str(t) for t in texts])


def parse(texts: Iterable[str]) -> list[Override]:
    """Every text parsed; raises Hydra's ``OverrideParseException`` on the first it refuses."""
    return [parse_one(str(t)) for t in texts]


@lru_cache(maxsize=4096)  # a command line is read by several checks before Hydra's run (~1 ms a parse)
def parse_one(text: str) -> Override:
    return _ours(hydra_parse([text])[0], text)


def key(text: str) -> str:
    """The key (or group) ``text`` sets, without ``+``/``++``/``~``."""
    return parse_one(text).key


def sets(texts: Iterable[str], k: str) -> bool:
    """Whether one of ``texts`` sets (adds, deletes) the key ``k``."""
    return any(o.key == k for o in parse(texts))


def try_parse(texts: Iterable[str]) -> list[Override]:
    """The texts Hydra accepts, parsed; the others (a Hydra flag or a flag's value on a command line) left out."""
    out = []
    for t in texts:
        try:
            out.append(parse_one(t))
        except Exception:  # noqa: BLE001 - Hydra's OverrideParseException, or a lexer error inside it: not an override
            continue
    return out


def is_hydra_key(k: str) -> bool:
    """A key of Hydra's own config (``hydra.run.dir``, ``hydra/launcher``), not of the run's."""
    return k == "hydra" or k.startswith(("hydra.", "hydra/"))


def is_point_key(k: str) -> bool:
    """A key that tells one run of a sweep from another (not Hydra's, not ``NOT_A_POINT_KEY``)."""
    return not is_hydra_key(k) and k not in NOT_A_POINT_KEY


def point_values(texts: Iterable[str]) -> dict[str, str]:
    """key -> value as typed of the overrides that tell runs apart (``is_point_key``; ``~key`` gives ""): a sweep
    point's W&B name, its directory name, the report's columns."""
    return {o.key: o.value or "" for o in parse(texts) if is_point_key(o.key)}


def swept_keys(texts: Iterable[str]) -> set[str]:
    """The keys given a sweep value among ``texts`` (a command line: flags and their values are skipped)."""
    return {o.key for o in try_parse(t for t in texts if not str(t).startswith("-")) if o.sweep}


def first_values(texts: Iterable[str]) -> list[str]:
    """The overrides with each sweep replaced by its first value (``a,b`` -> ``a``); a sweep with no value
    (``range(0,0)``) is left out. Raises Hydra's ``OverrideParseException`` on a text it refuses."""
    out = []
    for o in hydra_parse(texts):
        if o.is_sweep_override():
            first = next(iter(o.sweep_string_iterator()), None)
            if first is not None:
                out.append(f"{o.get_key_element()}={first}")
        else:
            out.append(o.input_line)
    return out


def split_text(text: str) -> tuple[str, str, str | None]:
    """``(prefix, key, value)`` of ``text`` by its characters alone (value None: no ``=``). For the two readers
    that cannot use the parser: a text Hydra refused (its error message names the parts), and
    ``devices.device_kind`` before the allocator's re-exec (Hydra not loaded yet, see the module's docstring)."""
    head, eq, value = text.partition("=")
    prefix = next((p for p in ("++", "+", "~") if head.startswith(p)), "")
    return prefix, head[len(prefix):], value if eq else None
