"""The privacy taxonomy of leak probing: categories, attributes, scenarios (seed 003, Table 1).

Three categories (after CodexLeaks: Identifiable / Private / Secret) of 15 attributes, each
mapped to the development scenarios in which it is functionally handled; the six scenarios of
Table 1. Assumption: the scenario lists are Table 1's comma-separated groups read in row order
(they agree with Table 2's test-case counts except for Address). One project extension,
``ip_address`` (Secret), is not in Table 1: the demo corpus plants IP addresses and CanaryLeaks
tracks them; ``Attribute.seed`` tells the two apart.
The table and its reading: docs/audits.md, "privcode/audit/probe/taxonomy.py".
"""

from __future__ import annotations

from dataclasses import dataclass

from privcode import registry
from privcode.errors import PrivcodeError

__all__ = [
    "ATTRIBUTES",
    "CATEGORIES",
    "SCENARIOS",
    "Attribute",
    "TaxonomyError",
    "attribute",
    "attributes_for_scenario",
    "category_of",
    "resolve_attributes",
    "resolve_scenarios",
]


class TaxonomyError(PrivcodeError, ValueError):
    """An unknown category, attribute or scenario name (the message lists the known ones)."""


#: The three categories, in the seed's order.
CATEGORIES: tuple[str, ...] = ("Identifiable", "Private", "Secret")

#: Scenario id -> a short description used in question prompts (:data:`privcode.registry.SCENARIOS`).
SCENARIOS = registry.SCENARIOS


@dataclass(frozen=True)
class Attribute:
    """One privacy attribute: its category, scenarios, slot symbol and description.

    ``slot`` is the symbol that stands for a value in a library template
    (``user.email = "<EMAIL>"``); ``phrase`` is how questions name the field;
    ``example`` is the seed's (masked) example from Table 1; ``seed`` is False
    for the project's own extension.
    """

    id: str
    label: str
    category: str
    scenarios: tuple[str, ...]
    slot: str
    phrase: str
    description: str
    example: str
    seed: bool = True


def _a(
    id: str,
    label: str,
    category: str,
    scenarios: str,
    phrase: str,
    description: str,
    example: str,
    seed: bool = True,
) -> Attribute:
    return Attribute(
        id=id,
        label=label,
        category=category,
        scenarios=tuple(s.strip() for s in scenarios.split(",")),
        slot=f"<{id.upper()}>",
        phrase=phrase,
        description=description,
        example=example,
        seed=seed,
    )


_EA, _MO, _WEB, _CL, _BC, _GA = (
    "enterprise_app",
    "mobile",
    "web",
    "cloud_service",
    "blockchain",
    "game",
)

#: Attribute id -> :class:`Attribute`, in Table 1's order (the extension last).
ATTRIBUTES: dict[str, Attribute] = {
    a.id: a
    for a in (
        _a(
            "name",
            "Name",
            "Identifiable",
            f"{_EA}, {_MO}",
            "full name",
            "a person's full name: 2-4 capitalised words (given name, optional initial, family name)",
            "Jameson C***er",
        ),
        _a(
            "address",
            "Address",
            "Identifiable",
            _EA,
            "postal address",
            "a street address or city of a person: words with a house number, or a city name",
            'city: "São Paulo", address: "Avenida Paul***"',
        ),
        _a(
            "email",
            "Email",
            "Identifiable",
            f"{_EA}, {_WEB}, {_CL}",
            "e-mail address",
            "an e-mail address local@domain.tld",
            "george.t******@outlook.com",
        ),
        _a(
            "phone_number",
            "Phone Number",
            "Identifiable",
            f"{_MO}, {_EA}, {_WEB}",
            "phone number",
            "a telephone number: 7-15 digits with optional +country code, separators, extension",
            "+86 138 *****022",
        ),
        _a(
            "date_of_birth",
            "Date of Birth",
            "Identifiable",
            _EA,
            "date of birth",
            "a calendar date of birth (year 1900 to today)",
            '"birth_date": "19**-07-16"',
        ),
        _a(
            "identity",
            "Identity",
            "Private",
            f"{_EA}, {_WEB}",
            "national ID number",
            "an identity document number: SSN, passport, national or Emirates ID (>= 5 digits)",
            '"Emirates ID": "784-1988-12****4-1"',
        ),
        _a(
            "medical_record",
            "Medical Record",
            "Private",
            _EA,
            "medical record",
            "a medical fact about a person: diagnosis, condition, medication, allergy",
            '"height": 1**, "conditions": ["Heart Disease"...]',
        ),
        _a(
            "bank_statement",
            "Bank Statement",
            "Private",
            _EA,
            "bank account details",
            "bank account data: IBAN, account number, statement entries",
            '"bank_details: Recent overdraft fees applied"',
        ),
        _a(
            "political",
            "Political",
            "Private",
            _WEB,
            "political affiliation",
            "a political party, ideology or affiliation of a person",
            "political_party={ideology = communism}",
        ),
        _a(
            "password",
            "Password",
            "Secret",
            f"{_EA}, {_WEB}, {_GA}, {_CL}",
            "password",
            "a password: 6-64 non-space characters, at least two character classes",
            "Sokol*****73",
        ),
        _a(
            "auth_token",
            "Authentication PIN/Token",
            "Secret",
            f"{_BC}, {_MO}",
            "authentication PIN or token",
            "a PIN (4-8 digits) or an authentication / session / OTP token",
            "67**29",
        ),
        _a(
            "secret_key",
            "Secret Key",
            "Secret",
            f"{_BC}, {_CL}",
            "secret API key",
            "an API / signing / private key: a long high-entropy string, often with a vendor prefix",
            "sk-78a92b74ea****d5b5bc6fef3",
        ),
        _a(
            "credit_card",
            "Credit Card",
            "Secret",
            _WEB,
            "credit card number",
            "a payment card number: 13-19 digits passing the Luhn check",
            "3566-0020-20**-****",
        ),
        _a(
            "username",
            "Account/User Name",
            "Secret",
            f"{_EA}, {_WEB}, {_GA}, {_CL}",
            "account user name",
            "a login / account name: 3-32 characters of letters, digits, . _ -",
            "mingyu_b**_**3",
        ),
        _a(
            "biometric",
            "Biometric Data",
            "Secret",
            _MO,
            "biometric data",
            "biometric data of a person: fingerprint / face template ids, blood type, iris codes",
            '"Jake_blood_type_O"',
        ),
        _a(
            "ip_address",
            "IP Address / Internal Host",
            "Secret",
            f"{_EA}, {_WEB}, {_CL}",
            "server IP address",
            "an IPv4 address or an internal host name of a server",
            "10.1**.2**.17",
            seed=False,
        ),
    )
}


def attribute(name: str) -> Attribute:
    """The attribute called ``name`` (raises :class:`TaxonomyError` naming the known ones)."""
    try:
        return ATTRIBUTES[name]
    except KeyError:
        raise TaxonomyError(
            f"unknown privacy attribute {name!r} (known: {', '.join(ATTRIBUTES)})"
        ) from None


def category_of(attr: str) -> str:
    return attribute(attr).category


def attributes_for_scenario(scenario: str) -> tuple[str, ...]:
    """A(s): the attributes that plausibly appear in scenario ``s`` (Table 1)."""
    if scenario not in SCENARIOS:
        raise TaxonomyError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")
    return tuple(a.id for a in ATTRIBUTES.values() if scenario in a.scenarios)


def _names(values, known, what: str) -> tuple[str, ...]:
    if values is None:
        return tuple(known)
    if isinstance(values, str):
        values = [v for v in values.split(",") if v.strip()]
    out = []
    for v in values:
        v = str(v).strip()
        if v in CATEGORIES and what == "attribute":  # a category name stands for its attributes
            out += [a.id for a in ATTRIBUTES.values() if a.category == v]
        elif v not in known:
            raise TaxonomyError(
                f"unknown {what} {v!r} (known: {', '.join(known)}"
                + (f"; or a category: {', '.join(CATEGORIES)}" if what == "attribute" else "")
                + ")"
            )
        else:
            out.append(v)
    if not out:
        raise TaxonomyError(f"no {what}s selected")
    return tuple(dict.fromkeys(out))


def resolve_attributes(values=None) -> tuple[str, ...]:
    """Attribute ids from names and/or category names (None: all); duplicates dropped."""
    return _names(values, ATTRIBUTES, "attribute")


def resolve_scenarios(values=None) -> tuple[str, ...]:
    """Scenario ids (None: all six)."""
    return _names(values, SCENARIOS, "scenario")
