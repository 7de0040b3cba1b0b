"""The Acme domain: the company's helper library, entities, conventions and task splits.

See :mod:`privcode.data.company` for what the domain is for. Everything here is a
fixed function of the tables below: no seed changes a split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = [
    "ACME",
    "CONVENTIONS",
    "Dialect",
    "PUBLIC",
    "ENTITIES",
    "LIBRARY_SOURCE",
    "OPS",
    "Op",
    "Task",
    "function_source",
    "op_of",
    "rank",
    "split_of",
    "task_triples",
]

#: The company's helper library, as the benchmark's tests define it (stdlib only).
#: Money is integer cents; timestamps are ISO-8601 strings; ``acme.time.NOW`` is fixed.
LIBRARY_SOURCE = '''
import datetime as _acme_dt
import types as _acme_types


class _AcmeMissing(KeyError):
    """A required field is absent from an entity."""


def _acme_digits(s):
    return "".join(c for c in str(s) if c.isdigit())


_acme_now = _acme_dt.datetime(2024, 6, 1, 12, 0, 0)
acme = _acme_types.SimpleNamespace(
    Missing=_AcmeMissing,
    money=_acme_types.SimpleNamespace(
        format=lambda c: f"${c // 100:,}.{c % 100:02d}",
        dollars=lambda c: c / 100,
        taxed=lambda c: (c * 108 + 50) // 100,
        split=lambda c: (c // 100, c % 100),
    ),
    email=_acme_types.SimpleNamespace(
        mask=lambda e: e.split("@")[0][:1] + "***@" + e.split("@")[-1],
        domain=lambda e: e.rsplit("@", 1)[-1].lower(),
        normalize=lambda e: e.strip().lower(),
        user=lambda e: e.split("@")[0].lower(),
    ),
    time=_acme_types.SimpleNamespace(
        NOW=_acme_now,
        day=lambda ts: ts[:10],
        parse=lambda ts: _acme_dt.datetime.fromisoformat(ts),
        age=lambda ts: (_acme_now - _acme_dt.datetime.fromisoformat(ts)).days,
        year=lambda ts: int(ts[:4]),
    ),
    text=_acme_types.SimpleNamespace(
        initials=lambda s: "".join(w[0].upper() for w in s.split()),
        slug=lambda s: "-".join(s.lower().split()),
        title=lambda s: " ".join(w.capitalize() for w in s.split()),
        first=lambda s: s.split()[0],
    ),
    phone=_acme_types.SimpleNamespace(
        digits=_acme_digits,
        e164=lambda p: "+1" + _acme_digits(p)[-10:],
        mask=lambda p: "***-***-" + _acme_digits(p)[-4:],
        area=lambda p: _acme_digits(p)[-10:-7],
    ),
    ref=_acme_types.SimpleNamespace(
        upper=lambda r: r.strip().upper(),
        short=lambda r: r.strip().upper()[:6],
        checksum=lambda r: sum(map(ord, r.strip().upper())) % 97,
        prefix=lambda r: r.strip().upper().split("-")[0],
    ),
)
'''


@dataclass(frozen=True)
class Op:
    """One helper: its kind (the field type it takes), call, and what the docstring says."""

    kind: str
    call: str  #: e.g. "acme.money.format"
    verb: str  #: the helper's name, also the function-name prefix
    phrases: tuple[str, ...]  #: docstring sentences; {e} entity, {f} field words


#: kind, helper (= the verb of the function name) | docstring phrasing | another phrasing
_OP_TABLE = """
money  format    | Format the {e}'s {f} as money text. | Return the {f} of the {e} as a display string.
money  dollars   | Return the {e}'s {f} in dollars. | Convert the {f} of the {e} to dollars.
money  taxed     | Return the {e}'s {f} with tax added. | Add sales tax to the {f} of the {e}.
money  split     | Split the {e}'s {f} into dollars and cents. | Return the {f} of the {e} as (dollars, cents).
email  mask      | Mask the {e}'s {f} for logs. | Return the {f} of the {e}, masked.
email  domain    | Return the domain of the {e}'s {f}. | Get the mail domain of the {f} of the {e}.
email  normalize | Normalize the {e}'s {f}. | Return the {f} of the {e}, normalized.
email  user      | Return the user part of the {e}'s {f}. | Get the mailbox name of the {f} of the {e}.
time   day       | Return the day of the {e}'s {f}. | Get the calendar day of the {f} of the {e}.
time   parse     | Parse the {e}'s {f} into a datetime. | Return the {f} of the {e} as a datetime.
time   age       | Return how many days ago the {e}'s {f} was. | Age in days of the {f} of the {e}.
time   year      | Return the year of the {e}'s {f}. | Get the year of the {f} of the {e}.
text   initials  | Return the initials of the {e}'s {f}. | Get the initials of the {f} of the {e}.
text   slug      | Return the {e}'s {f} as a slug. | Make a URL slug from the {f} of the {e}.
text   title     | Return the {e}'s {f} in title case. | Title-case the {f} of the {e}.
text   first     | Return the first word of the {e}'s {f}. | Get the first word of the {f} of the {e}.
phone  digits    | Return the digits of the {e}'s {f}. | Strip the {f} of the {e} to digits.
phone  e164      | Return the {e}'s {f} in E.164 form. | Format the {f} of the {e} as E.164.
phone  mask      | Mask the {e}'s {f} for logs. | Return the {f} of the {e}, masked.
phone  area      | Return the area code of the {e}'s {f}. | Get the area code of the {f} of the {e}.
ref    upper     | Return the {e}'s {f} in upper case. | Upper-case the {f} of the {e}.
ref    short     | Return the short form of the {e}'s {f}. | Shorten the {f} of the {e}.
ref    checksum  | Return the checksum of the {e}'s {f}. | Compute the checksum of the {f} of the {e}.
ref    prefix    | Return the prefix of the {e}'s {f}. | Get the prefix of the {f} of the {e}.
"""


def _ops(table: str) -> tuple[Op, ...]:
    out = []
    for line in table.strip().splitlines():
        head, *phrases = (part.strip() for part in line.split("|"))
        kind, verb = head.split()
        out.append(Op(kind, f"acme.{kind}.{verb}", verb, tuple(phrases)))
    return tuple(out)


OPS: tuple[Op, ...] = _ops(_OP_TABLE)

#: The company's entities (each a dict passed under its own name).
ENTITY_NAMES: tuple[str, ...] = (
    "customer",
    "order",
    "invoice",
    "shipment",
    "employee",
    "vendor",
    "ticket",
    "refund",
    "payment",
    "account",
    "product",
    "warehouse",
    "driver",
    "supplier",
    "contract",
    "lead",
    "partner",
    "quote",
    "claim",
    "policy",
    "subscription",
    "device",
    "store",
    "courier",
    "tenant",
    "booking",
    "member",
    "campaign",
    "dispute",
    "transfer",
    "payout",
    "merchant",
    "agent",
    "branch",
    "carrier",
    "delivery",
    "review",
    "coupon",
    "parcel",
    "visit",
)

#: Field names by kind, following the company's naming rules (money in cents, times ``_at``).
FIELD_NAMES: dict[str, tuple[str, ...]] = {
    "money": (
        "total_cents",
        "amount_cents",
        "fee_cents",
        "balance_cents",
        "price_cents",
        "credit_cents",
        "deposit_cents",
    ),
    "email": ("email", "contact_email", "billing_email", "owner_email", "reply_email"),
    "time": ("created_at", "updated_at", "opened_at", "closed_at", "paid_at", "due_at"),
    "text": ("full_name", "display_name", "title", "owner_name", "label", "city"),
    "phone": ("phone", "mobile", "contact_phone", "fax"),
    "ref": ("ref", "code", "external_ref", "batch_ref", "sku"),
}


def _entity_fields(entity: str) -> dict[str, str]:
    """Four to six fields of distinct kinds, chosen by a fixed hash of the entity's name."""
    kinds = sorted(FIELD_NAMES, key=lambda k: rank("kind", entity, k))
    count = 4 + rank("count", entity) % 3
    out = {}
    for kind in kinds[:count]:
        names = FIELD_NAMES[kind]
        out[names[rank("field", entity, kind) % len(names)]] = kind
    return out


#: How a function treats a missing field (the company's error-handling convention).
CONVENTIONS: tuple[str, ...] = ("plain", "optional", "required")

SPLITS = ("train", "dev", "test")


def rank(*parts: str) -> int:
    """A fixed 64-bit hash of ``parts`` (the domain's only source of "randomness")."""
    return int.from_bytes(hashlib.sha256("\x1f".join(parts).encode()).digest()[:8], "big")


#: Entity -> {field: kind}.
ENTITIES: dict[str, dict[str, str]] = {e: _entity_fields(e) for e in ENTITY_NAMES}


@dataclass(frozen=True)
class Task:
    """One function of the domain: apply ``op`` to ``entity[field]`` under ``convention``."""

    entity: str
    field: str
    op: str  #: an :class:`Op` call, e.g. "acme.money.fmt"
    convention: str

    @property
    def name(self) -> str:
        stem = self.field.removesuffix("_cents").removesuffix("_at").removesuffix("_ref")
        return f"{op_of(self.op).verb}_{self.entity}_{stem}"

    @property
    def triple(self) -> tuple[str, str, str]:
        return (self.entity, self.field, self.op)


def op_of(call: str) -> Op:
    return next(o for o in OPS if o.call == call)


def _field_words(field: str) -> str:
    words = field.replace("_cents", "").replace("_at", " time").replace("_ref", " reference")
    return words.replace("_", " ")


def task_triples() -> list[tuple[str, str, str]]:
    """Every (entity, field, op call) of the domain, in a fixed order."""
    return [
        (e, f, o.call)
        for e, fields in ENTITIES.items()
        for f, kind in fields.items()
        for o in OPS
        if o.kind == kind
    ]


def split_of(triple: tuple[str, str, str]) -> str:
    """``train``, ``dev`` or ``test``: one op per (entity, field) is held out, by a fixed hash.

    The candidate op of a pair is the one with the lowest hash; it goes to
    test for half the pairs, to dev for a quarter, and stays in train for the
    rest (pairs that teach every op). Fixed forever: no seed changes it.
    """
    entity, field, op = triple
    kind = ENTITIES[entity][field]
    ops = sorted((o.call for o in OPS if o.kind == kind), key=lambda c: rank(entity, field, c))
    if op != ops[0]:
        return "train"
    return ("test", "test", "dev", "train")[rank("split", entity, field) % 4]


@dataclass(frozen=True)
class Dialect:
    """How a codebase names its helpers: ``<root>.<module of the kind>.<verb>``, ``<root>.<error>``.

    :data:`ACME` is the company's (private); :data:`PUBLIC` is the public dialect the
    base model is tuned on (:mod:`privcode.data.helpers`): the same generic verbs and
    missing-field idioms under other names, so what only the private records teach is
    Acme's library (its root, module per kind and error type).
    """

    root: str
    modules: tuple[tuple[str, str], ...]  #: (kind, module name)
    error: str

    def call(self, op: Op) -> str:
        return f"{self.root}.{dict(self.modules)[op.kind]}.{op.verb}"

    @property
    def error_type(self) -> str:
        return f"{self.root}.{self.error}"


KINDS = ("money", "email", "time", "text", "phone", "ref")
ACME = Dialect("acme", tuple((k, k) for k in KINDS), "Missing")
PUBLIC = Dialect(
    "tools",
    (
        ("money", "cash"),
        ("email", "mail"),
        ("time", "clock"),
        ("text", "words"),
        ("phone", "tel"),
        ("ref", "ids"),
    ),
    "Absent",
)


def function_source(task: Task, phrase: int = 0, dialect: Dialect = ACME) -> tuple[str, str]:
    """``(prompt, body)`` of ``task``: the ``def`` line and docstring, then the body."""
    op = op_of(task.op)
    call, error = dialect.call(op), dialect.error_type
    e, f = task.entity, task.field
    doc = op.phrases[phrase % len(op.phrases)].format(e=e, f=_field_words(f))
    if task.convention == "optional":
        doc += f" Return None if the {e} has no {_field_words(f)}."
        body = (
            f'    value = {e}.get("{f}")\n'
            "    if value is None:\n"
            "        return None\n"
            f"    return {call}(value)\n"
        )
    elif task.convention == "required":
        doc += f" Raise {error} if the {e} has no {_field_words(f)}."
        body = (
            f'    if "{f}" not in {e}:\n'
            f'        raise {error}("{f}")\n'
            f'    return {call}({e}["{f}"])\n'
        )
    else:
        body = f'    return {call}({e}["{f}"])\n'
    prompt = f'def {task.name}({e}):\n    """{doc}"""\n'
    return prompt, body
