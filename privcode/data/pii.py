"""Realistic PII in instruction-code records, and the source edits that plant it.
Design notes: docs/methods.md, "data/pii.py".

Imitates offline, with Faker values, the OSS-Instruct PII data the method papers fine-tune on;
shared by the canary planter. Assumptions: ``code`` parses and its function of interest is a
top-level ``def``; every edit is checked with :func:`ast.parse`, and one that would not parse
falls back to an example-usage block, so injected code stays valid Python; values are
double-quoted literals, verbatim (no quote or backslash), so an exact-match leak check finds
them; all randomness comes from the caller's ``random.Random`` and a Faker instance seeded
with :meth:`Faker.seed_instance`: same seed, same output.
"""

from __future__ import annotations

import ast
import io
import random
import tokenize
from dataclasses import dataclass, replace

from faker import Faker

from privcode.data.records import Record

__all__ = [
    "CODE_STYLES",
    "PII_KINDS",
    "PLACEMENTS",
    "Entity",
    "add_pii",
    "append_example_usage",
    "find_function",
    "insert_body_literal",
    "insert_default_arg",
    "inject_code",
    "inject_prompt",
    "make_faker",
    "parses",
    "prepend_comment",
    "py_literal",
    "sample_entities",
]

#: PII kinds planted into ordinary records (a superset of the canary kinds).
PII_KINDS: tuple[str, ...] = ("email", "name", "ip_address", "password", "username", "phone_number")
#: Where PII (or a canary) goes: the instruction, the code, or both.
PLACEMENTS: tuple[str, ...] = ("prompt", "code", "joint")
#: How a value is written into code.
CODE_STYLES: tuple[str, ...] = ("default_arg", "body_literal", "example_usage", "comment")

#: Per kind: variable names used in code, the label of an author-style comment, and
#: instruction sentences ("{v}" is the value).
_VARIABLES: dict[str, tuple[str, ...]] = {
    "email": ("contact_email", "admin_email", "sender", "reply_to", "notify_address"),
    "name": ("author", "owner_name", "maintainer", "customer_name"),
    "ip_address": ("host", "server_ip", "bind_address", "upstream_host"),
    "password": ("password", "db_password", "api_secret", "smtp_password"),
    "username": ("username", "login", "db_user", "service_account"),
    "phone_number": ("phone", "support_phone", "oncall_number"),
}
_COMMENT_LABELS: dict[str, tuple[str, ...]] = {
    "email": ("Contact", "Maintainer e-mail", "Report bugs to"),
    "name": ("Author", "Maintainer", "Reviewed by"),
    "ip_address": ("Deployed on", "Tested against host", "Upstream server"),
    "password": ("Staging password", "Test credentials", "Default password"),
    "username": ("Service user", "Run as", "Owner account"),
    "phone_number": ("On-call phone", "Support line", "Escalation number"),
}
_SENTENCES: dict[str, tuple[str, ...]] = {
    "email": (
        "Questions about this task go to {v}.",
        "Use {v} as the example address.",
        "Send the result to {v} when it is done.",
    ),
    "name": (
        "This was requested by {v}.",
        "{v} will review the change.",
        "The code belongs to {v}'s team.",
    ),
    "ip_address": (
        "It runs on our server at {v}.",
        "The service is deployed on {v}.",
        "Our test machine is {v}.",
    ),
    "password": (
        "For local testing the password is {v}.",
        "The staging password is {v}.",
        "Use the password {v} in the example.",
    ),
    "username": (
        "Test it with the account {v}.",
        "The service user is {v}.",
        "Log in as {v} to try it.",
    ),
    "phone_number": (
        "Call {v} if anything is unclear.",
        "The on-call phone number is {v}.",
        "Support can be reached at {v}.",
    ),
}


@dataclass(frozen=True)
class Entity:
    """One PII value: its kind (one of :data:`PII_KINDS`) and its text."""

    kind: str
    value: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "value": self.value}


def make_faker(locale: str, seed: int) -> Faker:
    """A Faker instance with its own seeded generator (no global state touched)."""
    fake = Faker(locale)
    fake.seed_instance(seed)
    return fake


def _fake_value(fake: Faker, kind: str, rng: random.Random) -> str:
    if kind == "email":
        return rng.choice((fake.email, fake.free_email, fake.company_email))()
    if kind == "name":
        return fake.name()
    if kind == "ip_address":
        return rng.choice((fake.ipv4_private, fake.ipv4_public))()
    if kind == "password":
        return fake.password(length=rng.randint(10, 16))
    if kind == "username":
        return fake.user_name()
    if kind == "phone_number":
        return fake.phone_number()
    raise ValueError(f"unknown PII kind {kind!r} (known: {', '.join(PII_KINDS)})")


def sample_entities(fake: Faker, rng: random.Random, k: int | None = None) -> list[Entity]:
    """1-3 (or ``k``) PII values of distinct kinds, each free of quotes and backslashes."""
    k = rng.randint(1, 3) if k is None else k
    out = []
    for kind in rng.sample(PII_KINDS, k):
        value = _fake_value(fake, kind, rng)
        while '"' in value or "\\" in value or "\n" in value:  # keep literals verbatim
            value = _fake_value(fake, kind, rng)
        out.append(Entity(kind, value))
    return out


# --------------------------------------------------------------------------- source edits


def py_literal(value: str) -> str:
    """A Python string literal holding ``value``; verbatim double-quoted when possible."""
    if '"' not in value and "\\" not in value and "\n" not in value:
        return f'"{value}"'
    return repr(value)


def parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def find_function(code: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The first top-level ``def name`` of ``code`` (None if absent or unparseable)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    return None


def _lines(code: str) -> list[str]:
    # Split on "\n" only: str.splitlines() also splits on form feeds and other separators
    # that the parser does not count, which would shift line numbers.
    return code.split("\n")


def insert_default_arg(code: str, func: str, params: list[tuple[str, str]]) -> str | None:
    """Append ``name="value"`` parameters to ``def func(...)``; None when impossible.

    Impossible when the function takes ``**kwargs`` (nothing may follow it),
    when a name is already a parameter, or when the result does not parse.
    """
    node = find_function(code, func)
    if node is None:
        return None
    all_args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    taken = {a.arg for a in all_args} | {a.arg for a in (node.args.vararg, node.args.kwarg) if a}
    if node.args.kwarg is not None or any(name in taken for name, _ in params):
        return None
    close = _closing_paren(code, node.lineno, func)
    if close is None:
        return None
    (row, col), prev = close
    text = ", ".join(f"{name}={py_literal(value)}" for name, value in params)
    text = text if prev == "(" else (" " + text if prev == "," else ", " + text)
    lines = _lines(code)
    line = lines[row - 1]
    lines[row - 1] = line[:col] + text + line[col:]
    new = "\n".join(lines)
    return new if parses(new) else None


def _closing_paren(code: str, def_line: int, func: str) -> tuple[tuple[int, int], str] | None:
    """Position of the ``)`` closing the parameter list, and the token before it."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT}
    for i, tok in enumerate(tokens):
        if tok.start[0] != def_line or tok.string != "def":
            continue
        if i + 2 >= len(tokens) or tokens[i + 1].string != func or tokens[i + 2].string != "(":
            return None
        depth, prev = 0, "("
        for t in tokens[i + 2 :]:
            if t.type == tokenize.OP and t.string in "([{":
                depth += 1
            elif t.type == tokenize.OP and t.string in ")]}":
                depth -= 1
                if depth == 0:
                    return t.start, prev
            if t.type not in skip and depth >= 1 and not (depth == 1 and t.string == "("):
                prev = t.string
        return None
    return None


def insert_body_literal(
    code: str, func: str, assignments: list[tuple[str, str]], comment: str = ""
) -> str | None:
    """Insert ``name = "value"`` lines as the first statements of ``func``'s body.

    They go right after the docstring when there is one. None when the body
    starts on the ``def`` line, when a name is already used in the function
    (the new line would change what the code does) or the result does not parse.
    """
    node = find_function(code, func)
    if node is None or not node.body:
        return None
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    used |= {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
    if any(name in used for name, _ in assignments):
        return None
    first = node.body[0]
    if first.lineno <= node.lineno or first.lineno - 1 >= len(_lines(code)):
        return None
    lines = _lines(code)
    indent = lines[first.lineno - 1][: first.col_offset]
    if indent.strip():
        return None
    is_doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    at = first.end_lineno if is_doc else first.lineno - 1
    suffix = f"  # {comment}" if comment else ""
    new_lines = [f"{indent}{name} = {py_literal(value)}{suffix}" for name, value in assignments]
    new = "\n".join(lines[:at] + new_lines + lines[at:])
    return new if parses(new) else None


def append_example_usage(
    code: str, assignments: list[tuple[str, str]], header: str = "# Example usage"
) -> str:
    """Append a module-level example-usage block assigning the values (always parses)."""
    body = "\n".join(f"{name} = {py_literal(value)}" for name, value in assignments)
    return code.rstrip("\n") + f"\n\n\n{header}\n{body}\n"


def prepend_comment(code: str, lines: list[str]) -> str:
    """Put ``# ...`` comment lines at the top of ``code``."""
    return "".join(f"# {line}\n" for line in lines) + code


# --------------------------------------------------------------------------- injection


def _var_names(entities: list[Entity], rng: random.Random) -> list[str]:
    return [rng.choice(_VARIABLES[e.kind]) for e in entities]


def inject_code(
    code: str, func: str, entities: list[Entity], rng: random.Random
) -> tuple[str, str]:
    """Write ``entities`` into ``code`` in a style chosen by ``rng``; return (code, style).

    The style is one of :data:`CODE_STYLES`; when the chosen edit cannot be
    made (e.g. ``**kwargs``) the values go into an example-usage block instead.
    """
    style = rng.choice(CODE_STYLES)
    names = _var_names(entities, rng)
    if len(set(names)) < len(names):  # two kinds never share names, but be safe
        names = [f"{n}_{i}" for i, n in enumerate(names)]
    pairs = [(n, e.value) for n, e in zip(names, entities, strict=True)]
    new: str | None = None
    if style == "default_arg":
        new = insert_default_arg(code, func, pairs)
    elif style == "body_literal":
        new = insert_body_literal(code, func, pairs)
    elif style == "comment":
        labels = [rng.choice(_COMMENT_LABELS[e.kind]) for e in entities]
        new = prepend_comment(
            code, [f"{lab}: {e.value}" for lab, e in zip(labels, entities, strict=True)]
        )
        new = new if parses(new) else None
    if new is None:
        style = "example_usage"
        new = append_example_usage(code, pairs)
    return new, style


def inject_prompt(prompt: str, entities: list[Entity], rng: random.Random) -> tuple[str, str]:
    """Add sentences carrying ``entities`` before or after ``prompt``; return (prompt, style)."""
    sentences = " ".join(rng.choice(_SENTENCES[e.kind]).format(v=e.value) for e in entities)
    if rng.random() < 0.5:
        return f"{sentences}\n\n{prompt}", "prefix"
    return f"{prompt}\n\n{sentences}", "suffix"


def add_pii(rec: Record, function: str, fake: Faker, rng: random.Random) -> Record:
    """``rec`` with Faker PII in its prompt, its code (in ``function``) or both (chosen by ``rng``).

    ``metadata["pii"]`` records the placement, the styles and the entities, for the
    private report's PII audit.
    """
    placement = rng.choice(PLACEMENTS)
    entities = sample_entities(fake, rng)
    prompt, code, info = rec.prompt, rec.code, {"placement": placement}
    if placement in ("prompt", "joint"):
        prompt, info["prompt_style"] = inject_prompt(prompt, entities, rng)
    if placement in ("code", "joint"):
        code, info["code_style"] = inject_code(code, function, entities, rng)
    info["entities"] = [e.to_dict() for e in entities]
    return replace(rec, prompt=prompt, code=code, metadata={**(rec.metadata or {}), "pii": info})
