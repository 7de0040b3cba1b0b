"""PII formats: values whose shape alone identifies the attribute (:func:`scan_formats`).

E-mail, IPv4, vendor-prefixed secret keys, IBAN (mod-97), card numbers (Luhn and an issuer
prefix), US SSNs and separated phone numbers. Ingestion counts them in the corpus it builds
(:func:`privcode.data.ingest.hygiene.scan`) and the leak probe reads them in generated
tests (:mod:`privcode.audit.probe.extract`, :mod:`privcode.audit.probe.judge`); they live
in the data layer so that both read the same rules. Written here rather than taken from a
PII library because the probe needs exactly these checks (mod-97, Luhn, priority without
overlap) and their stable attribute ids; detect-secrets covers the secrets side of ingestion.
"""

from __future__ import annotations

import re

__all__ = [
    "EMAIL_RE",
    "SECRET_RE",
    "card_shape",
    "iban_ok",
    "ipv4_ok",
    "luhn_ok",
    "phone_digits",
    "scan_formats",
]


def luhn_ok(digits: str) -> bool:
    """The Luhn (mod-10) check of a digit string."""
    if not digits.isdigit():
        return False
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def iban_ok(text: str) -> bool:
    """ISO 13616 check: move the first 4 characters to the end, letters -> 10..35, mod 97 == 1."""
    s = text.replace(" ", "").upper()
    if not re.fullmatch(r"[A-Z]{2}\d{2}[A-Z0-9]{10,30}", s):
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


SECRET_RE = re.compile(
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|(?<![\w-])(?:sk-(?:proj-)?[A-Za-z0-9_-]{16,}|(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,}"
    r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,}|AKIA[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,}"
    r"|AIza[0-9A-Za-z_-]{35}|glpat-[A-Za-z0-9_-]{20,}|hf_[A-Za-z0-9]{30,})(?![\w-])"
)
EMAIL_RE = re.compile(r"(?<![\w.%+-])[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,24}(?![\w-])")
_IPV4_RE = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.]|\.\d)")
_IBAN_RE = re.compile(
    r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?"
    r"(?![A-Za-z0-9])"
)
_CARD_RE = re.compile(r"(?<![\d.-])\d(?:[ -]?\d){12,18}(?![\d.])")
_SSN_RE = re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])")
_PHONE_RE = re.compile(
    r"(?<![\w+.-])(?:\+\d{1,3}[ .-]?|00\d{1,2}[ .-]|001-)?"
    r"(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])(?:\d{2,4}[ .-]){0,2}\d{3,4}"
    r"(?:\s?(?:x|ext\.?|#)\s?\d{1,5})?(?![\w.-]|\.\d)"
)
_CARD_PREFIX = re.compile(r"3[47]|4|5[1-5]|2[2-7]|6(?:011|5|4[4-9]|2)|35|3[068]")


def ipv4_ok(text: str) -> bool:
    """A dotted quad of 0..255 without leading zeros."""
    parts = text.split(".")
    return len(parts) == 4 and all(
        p.isdigit() and int(p) <= 255 and (p == "0" or not p.startswith("0")) for p in parts
    )


def phone_digits(text: str) -> str:
    """The digits of a phone number without its extension."""
    main = re.split(r"\s?(?:x|ext\.?|#)\s?\d", text, maxsplit=1)[0]
    return re.sub(r"\D", "", main)


def card_shape(text: str) -> bool:
    """13-19 digits with one kind of separator at most, a known issuer prefix and the Luhn check."""
    seps = set(re.sub(r"\d", "", text))
    digits = re.sub(r"\D", "", text)
    return (
        len(seps) <= 1
        and 13 <= len(digits) <= 19
        and luhn_ok(digits)
        and bool(_CARD_PREFIX.match(digits))
    )


def scan_formats(text: str) -> list[tuple[str, str]]:
    """(attribute, value) of every format-identified value in ``text``, non-overlapping.

    Priority: secret key, e-mail, IPv4, IBAN, card (Luhn), SSN, phone (7-15
    digits without the extension); each later pattern skips spans already taken.
    """
    taken: list[tuple[int, int]] = []
    out: list[tuple[int, str, str]] = []

    def free(a: int, b: int) -> bool:
        return all(b <= s or a >= e for s, e in taken)

    checks = (
        (SECRET_RE, "secret_key", None),
        (EMAIL_RE, "email", None),
        (_IPV4_RE, "ip_address", ipv4_ok),
        (_IBAN_RE, "bank_statement", iban_ok),
        (_CARD_RE, "credit_card", card_shape),
        (_SSN_RE, "identity", None),
        (_PHONE_RE, "phone_number", lambda v: 7 <= len(phone_digits(v)) <= 15),
    )
    for regex, attr, ok in checks:
        for m in regex.finditer(text):
            a, b = m.span()
            value = m.group(0)
            if free(a, b) and (ok is None or ok(value)):
                taken.append((a, b))
                out.append((a, attr, value))
    return [(attr, value) for _, attr, value in sorted(out)]
