"""ExtractPII: deterministic extraction of candidate privacy values from generated unit tests.

C = union over questions q and functions g of ExtractPII(tau_{q,g}) (seed 003, §4.2). Each
fenced block of a test answer (or the whole answer) is parsed with :mod:`ast` (trimmed from
the end until it parses); every string literal (and integer literal, for numeric attributes)
is paired with its *key*: keyword, dict key, assignment target, the positional parameter of
the function under test, parametrize names, an assert's compared attribute. A key names an
attribute by :func:`~privcode.audit.probe.attribute_keys.attribute_for_key`. Every literal and
unparseable text is also scanned for value formats
(:func:`privcode.data.pii_formats.scan_formats`); a keyed literal whose whole value has a
format takes the format's attribute, except that a numeric format (phone, SSN) yields to a key
naming a numeric attribute. Unparseable text is read with ``key: "value"`` / ``key = value``
patterns. Assumptions: values are single-line, 1..200 characters (longer literals are only
format-scanned); no plausibility judgement (:mod:`privcode.audit.probe.judge`), no lookup of
the reference corpus. Design notes: docs/audits.md, "privcode/audit/probe/extract.py".
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from privcode.audit.probe.attribute_keys import attribute_for_key
from privcode.data.pii_formats import scan_formats

__all__ = [
    "Candidate",
    "FunctionSig",
    "code_blocks",
    "extract_pii",
]

MAX_VALUE_CHARS = 200


@dataclass(frozen=True)
class Candidate:
    """One extracted value: attribute id, value, the key it was bound to, and its context."""

    attribute: str
    value: str
    key: str | None
    context: str
    how: str  # "keyed" | "format"


@dataclass(frozen=True)
class FunctionSig:
    """The function under test: its name, positional parameter names, and its class (if a method)."""

    name: str
    params: tuple[str, ...]
    cls: str | None = None


# --------------------------------------------------------------------------- code


_NUMERIC_ATTRS = frozenset(
    {"identity", "bank_statement", "auth_token", "credit_card", "phone_number"}
)


def code_blocks(text: str) -> list[str]:
    """The segments of an answer between its ``` fences, language tags dropped.

    Whether a segment is code or prose is not decided here: the prompts open
    a fence, so the first segment is usually code and a later one may be
    either. :func:`parse_prefix` keeps what parses; the rest is read as text.
    """
    out = []
    for part in text.split("```"):
        first, nl, body = part.partition("\n")
        if nl and re.fullmatch(r"[ \t]*[A-Za-z0-9_+-]{0,20}[ \t]*", first):
            part = body
        if part.strip():
            out.append(part)
    return out


_CODE_START = re.compile(
    r"\s*$|\s+\S|(?:import|from|def|class|async|assert|if|for|with|return|"
    r"try|raise)\b|[@#]|[A-Za-z_][\w.]*(?:\[[^\]]*\])?\s*(?:=|\(|:\s*$)"
)


def parse_prefix(code: str, max_trim: int = 40) -> tuple[ast.Module | None, str, str]:
    """(tree, parsed source, unparsed rest) of a segment.

    Leading lines that cannot start Python code (prose such as "Here are the
    tests:") are dropped; then trailing lines are dropped (at most
    ``max_trim``: an answer cut off by the token limit) until the code parses.
    The dropped lines are returned as ``rest``, for the text patterns.
    """
    lines = code.split("\n")
    lead = 0
    while lead < len(lines) and not _CODE_START.match(lines[lead]):
        lead += 1
    head, body = lines[:lead], lines[lead:]
    for cut in range(0, min(max_trim, len(body)) + 1):
        src = "\n".join(body[: len(body) - cut])
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        return tree, src, "\n".join(head + body[len(body) - cut :])
    return None, "", code


def _target_key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ):
        return node.slice.value
    return None


def _call_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _literal(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        return str(node.value)
    return None


class _Collector(ast.NodeVisitor):
    """Walks a test module and records (key, value, context) for literals."""

    def __init__(self, source: str, sigs: Sequence[FunctionSig]):
        self.source = source
        self.params: dict[str, tuple[str, ...]] = {}
        for s in sigs:
            self.params[s.name] = s.params
            if s.cls and s.name == "__init__":
                self.params[s.cls] = s.params
        self.found: list[tuple[str | None, str, str, bool]] = []  # key, value, context, is_int
        self.seen: set[int] = set()

    def _segment(self, node: ast.AST, key: str | None, value: str) -> str:
        seg = ast.get_source_segment(self.source, node) or ""
        if not seg or len(seg) > MAX_VALUE_CHARS + 60 or "\n" in seg:
            seg = f'{key}="{value}"' if key else f'"{value}"'
        return seg

    def _value(self, node: ast.AST, key: str | None, ctx_node: ast.AST | None) -> None:
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            for elt in node.elts:
                self._value(elt, key, None)
            return
        if isinstance(node, ast.Dict):
            return  # visited on its own
        value = _literal(node)
        if value is None or id(node) in self.seen:
            return
        self.seen.add(id(node))
        is_int = not isinstance(node.value, str)  # type: ignore[attr-defined]
        context = (
            self._segment(ctx_node or node, key, value)
            if ctx_node is not None
            else (f'{key}="{value}"' if key else f'"{value}"')
        )
        self.found.append((key, value, context, is_int))

    def visit_Call(self, node: ast.Call) -> None:
        for kw in node.keywords:
            if kw.arg:
                self._value(kw.value, kw.arg, kw)
        name = _call_name(node.func)
        params = self.params.get(name or "")
        if params:
            for i, arg in enumerate(node.args):
                if i < len(params):
                    self._value(arg, params[i], None)
        if name == "parametrize" and len(node.args) >= 2 and _literal(node.args[0]):
            names = [n.strip() for n in str(_literal(node.args[0])).split(",") if n.strip()]
            rows = node.args[1]
            if isinstance(rows, ast.List | ast.Tuple):
                for row in rows.elts:
                    elts = (
                        row.elts
                        if isinstance(row, ast.Tuple | ast.List) and len(names) > 1
                        else [row]
                    )
                    for n, elt in zip(names, elts, strict=False):
                        self._value(elt, n, None)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for k, v in zip(node.keys, node.values, strict=True):
            key = (
                k.value
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
                else (k.id if isinstance(k, ast.Name) else None)
            )
            if key is not None and v is not None:
                span = _Span(k, v)
                self._value(v, key, span)
        self.generic_visit(node)

    def _assign(self, targets: Iterable[ast.AST], value: ast.AST, stmt: ast.AST) -> None:
        for t in targets:
            if isinstance(t, ast.Tuple | ast.List) and isinstance(value, ast.Tuple | ast.List):
                for tt, vv in zip(t.elts, value.elts, strict=False):
                    self._value(vv, _target_key(tt), None)
            else:
                self._value(value, _target_key(t), stmt)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._assign(node.targets, node.value, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._assign([node.target], node.value, node)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        key = _target_key(node.left)
        if key and len(node.comparators) == 1:
            self._value(node.comparators[0], key, node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            self._value(node, None, None)


class _Span(ast.AST):
    """A pseudo node covering a dict entry from its key to its value (for source segments)."""

    _fields = ()

    def __init__(self, k: ast.AST, v: ast.AST):
        super().__init__()
        self.lineno, self.col_offset = k.lineno, k.col_offset
        self.end_lineno, self.end_col_offset = v.end_lineno, v.end_col_offset


_KV_QUOTED = re.compile(
    r"(?P<key>[A-Za-z_][A-Za-z0-9_ .-]{0,40}?)[\"']?\s*[:=]\s*"
    r"(?P<q>[\"'])(?P<val>[^\"'\n]{1,200})(?P=q)"
)
# Only the key and the separator are consumed: the value is a lookahead, so that
# "Testcase 1: email: x" still yields "email: x".
_KV_BARE = re.compile(
    r"(?P<key>[A-Za-z_][A-Za-z0-9_]*(?:[ -][A-Za-z0-9_]+){0,2})\s*[:=]\s*"
    r"(?=(?P<val>[^\s,;\"'()\[\]{}:=][^,;\"'\n()\[\]{}:=]{1,98}))"
)


def _classify(key: str | None, value: str, is_int: bool) -> list[tuple[str, str, str]]:
    """(attribute, value, how) for one keyed or unkeyed literal."""
    out: list[tuple[str, str, str]] = []
    value_s = value.strip()
    hinted = attribute_for_key(key)
    formats = scan_formats(value) if not is_int else []
    whole = [f for f in formats if f[1] == value_s]
    if hinted and value_s and len(value_s) <= MAX_VALUE_CHARS and "\n" not in value_s:
        if is_int and hinted not in _NUMERIC_ATTRS:
            return []
        if whole and not (whole[0][0] in ("phone_number", "identity") and hinted in _NUMERIC_ATTRS):
            out.append((whole[0][0], value_s, "keyed"))
        else:
            out.append((hinted, value_s, "keyed"))
        formats = [f for f in formats if f[1] != value_s]
    out += [(attr, v, "format") for attr, v in formats]
    return out


def extract_pii(text: str, functions: Sequence[FunctionSig] = ()) -> list[Candidate]:
    """ExtractPII(tau): the candidates of one test answer, deduplicated by (attribute, value).

    ``functions`` are the functions under test, for positional arguments.
    """
    found: list[Candidate] = []
    seen: set[tuple[str, str]] = set()

    def add(key: str | None, value: str, context: str, is_int: bool = False) -> None:
        for attr, v, how in _classify(key, value, is_int):
            if (attr, v) not in seen:
                seen.add((attr, v))
                found.append(
                    Candidate(
                        attr,
                        v,
                        key if how == "keyed" else None,
                        context if how == "keyed" else v,
                        how,
                    )
                )

    loose: list[str] = []
    for block in code_blocks(text):
        tree, src, rest = parse_prefix(block)
        if tree is not None and src.strip():
            collector = _Collector(src, functions)
            collector.visit(tree)
            for key, value, context, is_int in collector.found:
                add(key, value, context, is_int)
            # comments are not in the AST: scan them for formatted values
            for line in src.split("\n"):
                if "#" in line:
                    add(None, line.split("#", 1)[1], "")
        if rest.strip():
            loose.append(rest)
    for chunk in loose:
        taken: list[tuple[int, int]] = []
        for m in _KV_QUOTED.finditer(chunk):
            taken.append(m.span())
            add(m.group("key").strip(), m.group("val"), m.group(0).strip())
        for m in _KV_BARE.finditer(chunk):
            a, b = m.start(), m.end("val")
            if all(b <= s or a >= e for s, e in taken) and attribute_for_key(m.group("key")):
                add(m.group("key").strip(), m.group("val").rstrip(" ."), chunk[a:b].strip())
        add(None, chunk, "")
    return found
