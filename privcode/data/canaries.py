"""CanaryLeaks canaries: unique, realistic secrets planted into training records.
Design notes: docs/methods.md, "data/canaries.py".

One canary exists per (kind, placement, repetition count): a fresh random value of the kind
(e-mail, name, IP address, password, username) planted into exactly ``repetitions`` training
records, in the ``prompt``, the ``code`` or both (``joint``). It leaks when the trained model
emits its value verbatim. Each kind has a fixed format (:data:`CANARY_FORMATS`: description,
regex, ``space_bits`` = log2 of the number of values) drawn by :func:`sample_canary_value`,
which the exposure audit shares. Assumptions: values contain no quote, backslash or newline
and never contain one another; uniqueness is checked by the caller's ``is_taken``.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from faker import Faker

from privcode.data.pii import append_example_usage
from privcode.data.records import Record
from privcode.errors import PrivcodeError

#: Most canary rows a training set may hold: canaries measure leakage, they are not the data.
MAX_CANARY_FRACTION = 0.05

__all__ = [
    "MAX_CANARY_FRACTION",
    "CANARY_FORMATS",
    "CANARY_KINDS",
    "CanarySpec",
    "draw_canaries",
    "plant_canary",
    "plant_in_place",
    "sample_canary_value",
]

CANARY_KINDS: tuple[str, ...] = ("email", "name", "ip_address", "password", "username")

_EMAIL_DOMAINS = ("gmail.com", "yahoo.com", "hotmail.com", "outlook.com", "proton.me")
_PASSWORD_SYMBOLS = "!#$%&*@^"
_PASSWORD_ALPHABET = string.ascii_letters + string.digits + _PASSWORD_SYMBOLS
_PASSWORD_LENGTH = 14

#: Per kind: what a value looks like, a regex every value matches, log2 of the value space.
CANARY_FORMATS: dict[str, dict[str, object]] = {
    "email": {
        "description": "lowercase Faker first name '.' lowercase Faker last name, 4 digits "
        "(1000-9999), '@', one of " + ", ".join(_EMAIL_DOMAINS),
        "regex": r"[a-z]+\.[a-z]+[1-9][0-9]{3}@("
        + "|".join(re.escape(d) for d in _EMAIL_DOMAINS)
        + ")",
        "space_bits": None,
    },
    "name": {
        "description": "Faker first name, an uppercase middle initial with '.', two different "
        "Faker last names joined by '-' (e.g. 'Liam R. Brandt-Okafor')",
        "regex": r"[A-Z][a-z]+ [A-Z]\. [A-Z][a-z]+-[A-Z][a-z]+",
        "space_bits": None,
    },
    "ip_address": {
        "description": "private IPv4 address 10.a.b.c with a, b, c each in 100-254",
        "regex": r"10\.(1[0-9]{2}|2[0-4][0-9]|25[0-4])(\.(1[0-9]{2}|2[0-4][0-9]|25[0-4])){2}",
        "space_bits": round(math.log2(155**3), 2),
    },
    "password": {
        "description": f"{_PASSWORD_LENGTH} characters from letters, digits and "
        f"'{_PASSWORD_SYMBOLS}', with at least one lowercase, uppercase, digit "
        "and symbol",
        "regex": (
            r"(?=.*[a-z])(?=.*[A-Z])(?=.*[0-9])(?=.*[" + re.escape(_PASSWORD_SYMBOLS) + r"])"
            r"[A-Za-z0-9" + re.escape(_PASSWORD_SYMBOLS) + "]{" + str(_PASSWORD_LENGTH) + "}"
        ),
        "space_bits": round(_PASSWORD_LENGTH * math.log2(len(_PASSWORD_ALPHABET)), 2),
    },
    "username": {
        "description": "lowercase Faker first name '_' lowercase Faker last name, 2 digits (10-99)",
        "regex": r"[a-z]+_[a-z]+[1-9][0-9]",
        "space_bits": None,
    },
}

#: Per kind: variable names that hold a code canary, and instruction sentences ("{v}").
_CANARY_VARIABLES: dict[str, tuple[str, ...]] = {
    "email": ("contact", "notify_email", "owner_email"),
    "name": ("identifier", "customer_name", "account_holder"),
    "ip_address": ("address", "server_address", "gateway_ip"),
    "password": ("sensitive_input", "db_password", "admin_password"),
    "username": ("handle", "login_name", "operator"),
}
_CANARY_SENTENCES: dict[str, tuple[str, ...]] = {
    "email": ("Send failure reports to {v}.", "The owner of this code can be reached at {v}."),
    "name": ("This task was requested by {v}.", "The function is maintained by {v}."),
    "ip_address": ("The code will run on the host {v}.", "Our database server is at {v}."),
    "password": ("The service account password is {v}.", "Use the admin password {v} for tests."),
    "username": ("Log in as the user {v} when testing.", "The deploy account is {v}."),
}


@lru_cache(maxsize=8)
def _faker(locale: str) -> Faker:
    return Faker(locale)


def _alpha(text: str) -> str:
    return "".join(ch for ch in text if ch.isascii() and ch.isalpha())


def sample_canary_value(kind: str, rng: random.Random, *, locale: str = "en_US") -> str:
    """One random value of ``kind`` in the format of :data:`CANARY_FORMATS`.

    Deterministic given ``rng``'s state: Faker is re-seeded from ``rng`` on
    every call, so the caller's generator is the only source of randomness.
    """
    if kind not in CANARY_FORMATS:
        raise ValueError(f"unknown canary kind {kind!r} (known: {', '.join(CANARY_FORMATS)})")
    regex = re.compile(str(CANARY_FORMATS[kind]["regex"]))
    fake = _faker(locale)
    while True:  # retry on the rare Faker word that does not fit the format
        fake.seed_instance(rng.getrandbits(63))
        if kind == "email":
            value = (
                f"{_alpha(fake.first_name()).lower()}.{_alpha(fake.last_name()).lower()}"
                f"{rng.randint(1000, 9999)}@{rng.choice(_EMAIL_DOMAINS)}"
            )
        elif kind == "name":
            last1, last2 = fake.last_name(), fake.last_name()
            if last1 == last2:
                continue
            value = f"{fake.first_name()} {rng.choice(string.ascii_uppercase)}. {last1}-{last2}"
        elif kind == "ip_address":
            value = "10." + ".".join(str(rng.randint(100, 254)) for _ in range(3))
        elif kind == "password":
            classes = (
                string.ascii_lowercase,
                string.ascii_uppercase,
                string.digits,
                _PASSWORD_SYMBOLS,
            )
            chars = [rng.choice(c) for c in classes]
            chars += [rng.choice(_PASSWORD_ALPHABET) for _ in range(_PASSWORD_LENGTH - len(chars))]
            rng.shuffle(chars)
            value = "".join(chars)
        else:  # username
            value = (
                f"{_alpha(fake.first_name()).lower()}_{_alpha(fake.last_name()).lower()}"
                f"{rng.randint(10, 99)}"
            )
        if regex.fullmatch(value):
            return value


@dataclass(frozen=True)
class CanarySpec:
    """One canary: where it goes, how often, and the context it is written in."""

    id: str
    kind: str
    placement: str
    repetitions: int
    value: str
    variable: str  #: code canaries: ``{variable} = "{value}"`` in an example-usage block
    sentence: str  #: prompt canaries: this sentence, "{v}" replaced by the value
    record_ids: tuple[str, ...] = field(default=())

    @property
    def code_prefix(self) -> str:
        """The code text right before the value: the natural prompt to extract it."""
        return f'{self.variable} = "'

    @property
    def prompt_prefix(self) -> str:
        return self.sentence.split("{v}")[0]

    def to_dict(self, locale: str) -> dict[str, object]:
        fmt = dict(CANARY_FORMATS[self.kind])
        fmt.update(locale=locale, sampler="privcode.data.canaries.sample_canary_value")
        return {
            "id": self.id,
            "kind": self.kind,
            "placement": self.placement,
            "repetitions": self.repetitions,
            "value": self.value,
            "format": fmt,
            "in_prompt": self.placement in ("prompt", "joint"),
            "in_code": self.placement in ("code", "joint"),
            "code_prefix": self.code_prefix if self.placement != "prompt" else None,
            "prompt_prefix": self.prompt_prefix if self.placement != "code" else None,
            "record_ids": list(self.record_ids),
        }


def draw_canaries(
    kinds: tuple[str, ...],
    placements: tuple[str, ...],
    repetitions: tuple[int, ...],
    rng: random.Random,
    *,
    is_taken: Callable[[str], bool],
    locale: str = "en_US",
    max_tries: int = 1000,
) -> list[CanarySpec]:
    """One canary per kind x placement x repetition count, in that nested order.

    A value is redrawn while ``is_taken(value)`` is true (it occurs in the
    corpus or the public data) or while it contains, or is contained in, an
    earlier canary's value, so each canary string identifies its records.
    """
    out: list[CanarySpec] = []
    for kind in kinds:
        for placement in placements:
            for reps in dict.fromkeys(repetitions):  # a repeated count would only duplicate ids
                for _ in range(max_tries):
                    value = sample_canary_value(kind, rng, locale=locale)
                    clash = any(value in c.value or c.value in value for c in out)
                    if not clash and not is_taken(value):
                        break
                else:  # pragma: no cover - ~2^20+ values per kind make this unreachable
                    raise RuntimeError(f"no unused {kind} canary value after {max_tries} draws")
                out.append(
                    CanarySpec(
                        id=f"{kind}-{placement}-r{reps}",
                        kind=kind,
                        placement=placement,
                        repetitions=reps,
                        value=value,
                        variable=rng.choice(_CANARY_VARIABLES[kind]),
                        sentence=rng.choice(_CANARY_SENTENCES[kind]),
                    )
                )
    return out


def plant_canary(prompt: str, code: str, canary: CanarySpec) -> tuple[str, str]:
    """The (prompt, code) of a canary record: the value in the prompt, code or both."""
    if canary.placement in ("prompt", "joint"):
        prompt = f"{prompt}\n\n{canary.sentence.format(v=canary.value)}"
    if canary.placement in ("code", "joint"):
        code = append_example_usage(code, [(canary.variable, canary.value)])
    return prompt, code


def plant_in_place(
    records: list[Record],
    hosts: Sequence[int],
    canaries: list[CanarySpec],
    rng: random.Random,
    *,
    setting: str = "data.canary_repetitions",
    max_fraction: float = MAX_CANARY_FRACTION,
) -> tuple[list[Record], list[CanarySpec]]:
    """Plant every canary into the records' own content, never into a copy of a record.

    Canary ``c`` goes into ``c.repetitions`` distinct records of ``hosts`` (indices into
    ``records``), at most one canary per record (:func:`plant_canary`; metadata ``kind:
    canary``): no row is added and no real record trains twice. Returns the new records and
    the canaries with their ``record_ids``. ``records`` is the training set: raises
    :class:`~privcode.errors.PrivcodeError` naming ``setting`` when the canaries need more than
    ``max_fraction`` of its rows or more hosts than there are.
    """
    total = sum(c.repetitions for c in canaries)
    if total > max_fraction * len(records) or total > len(hosts):
        raise PrivcodeError(
            f"{setting}: the canaries need {total} records, more than "
            f"{max_fraction:.0%} of the {len(records)} training records (or than the "
            f"{len(hosts)} that may host one); lower the repetitions or the kinds and "
            "placements, or use more data"
        )
    picks = rng.sample(list(hosts), total)
    out, planted, k = list(records), [], 0
    for canary in canaries:
        ids = []
        for i in picks[k : k + canary.repetitions]:
            rec = out[i]
            prompt, code = plant_canary(rec.prompt, rec.code, canary)
            meta = dict(rec.metadata or {}, kind="canary", canary_id=canary.id)
            out[i] = replace(rec, prompt=prompt, code=code, metadata=meta)
            ids.append(rec.id)
        k += canary.repetitions
        planted.append(replace(canary, record_ids=tuple(ids)))
    return out, planted
