"""Record candidates from one source file: one per function, method and class.
Design notes: docs/methods.md, "data/ingest/units.py".

``extract_units(text, path, language)`` pairs each unit's documentation (the docstring, else
the comment block above it, else a template from the signature alone, never from the body)
with its source, dedented and *without* that documentation: a model trained on the pair must
write the code, not copy its description. Python goes through :mod:`ast`, other languages
through tree-sitter (:mod:`privcode.data.ingest.syntax`). Units under ``min_lines`` lines or
over ``max_bytes`` are skipped, as are definitions with a syntax error inside; nested
functions are part of their parent; methods are units, and so is their class.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
import warnings
from dataclasses import dataclass
from typing import Literal

from tree_sitter import Node

from privcode.data.ingest.syntax import parses, ts_parser

__all__ = ["LANGUAGES", "CodeUnit", "extract_units", "language_of"]

#: Language name -> the file suffixes that hold it (``.tsx`` uses the TSX grammar).
LANGUAGES: dict[str, tuple[str, ...]] = {
    "python": (".py",),
    "javascript": (".js", ".mjs", ".cjs", ".jsx"),
    "typescript": (".ts", ".tsx"),
    "go": (".go",),
    "java": (".java",),
    "rust": (".rs",),
    "c": (".c", ".h"),
    "cpp": (".cc", ".cpp", ".cxx", ".hpp", ".hh", ".hxx"),
}
_BY_SUFFIX = {suffix: lang for lang, suffixes in LANGUAGES.items() for suffix in suffixes}
_DESCRIPTION_CHARS = 600
_LONG_DEFAULT = 24  # default values longer than this are shown as "..." in a template

Kind = Literal["function", "method", "class"]


@dataclass(frozen=True)
class CodeUnit:
    """One function, method or class of a file, with the prompt that asks for it."""

    language: str
    path: str
    start_line: int  #: first line of the code (decorators included), 1-based
    end_line: int  #: last line, inclusive
    kind: str  #: "function" | "method" | "class"
    name: str  #: qualified for methods and nested classes: "Owner.name" ("::" in Rust, C++)
    prompt: str
    code: str  #: ends with a newline; the documentation that became the prompt is cut out
    prompt_source: str  #: "docstring" | "comment" | "template"


def language_of(path: str) -> str | None:
    """The language of a file by its suffix (case-insensitive), None when not ingested."""
    return _BY_SUFFIX.get(os.path.splitext(path)[1].lower())


def extract_units(
    text: str, path: str, language: str, *, min_lines: int = 3, max_bytes: int = 65536
) -> list[CodeUnit]:
    """The units of one file's ``text``, in source order (a class before its methods)."""
    if language not in LANGUAGES:
        raise ValueError(f"unknown language {language!r}: expected one of {sorted(LANGUAGES)}")
    if language == "python":
        return _python_units(text, path, min_lines, max_bytes)
    return _TreeSitterUnits(text, path, language, min_lines, max_bytes).run()


# --------------------------------------------------------------------------- prompts

#: Tool directives, not documentation (a comment line starting with one is dropped).
_PRAGMAS = (
    "!", "-*-", "type:", "noqa", "pragma:", "fmt:", "pylint:", "mypy:", "isort:", "go:",
    "+build", "nolint", "NOLINT", "eslint-", "eslint ", "@ts-", "prettier-ignore",
    "clang-format", "istanbul ignore", "jshint", "SPDX-License-Identifier",
)  # fmt: skip
_SUMMARY_TAGS = ("@brief", "\\brief", "@summary", "@description")  # the description itself
_RULE = re.compile(r"^[^\w\s]*$")  # a line of only punctuation: "-----", "*****"


def _describe(lines: list[str], limit: int = _DESCRIPTION_CHARS) -> str:
    """Paragraphs joined into prose, stopping at doctests, code fences or ``limit`` chars."""
    paragraphs: list[str] = []
    current: list[str] = []
    for line in [*lines, ""]:
        s = line.strip()
        if s and not _RULE.match(s):
            current.append(s)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    out: list[str] = []
    size = 0
    for para in paragraphs:
        if para.startswith((">>>", "```")) or (out and size + len(para) > limit):
            break
        if len(para) > limit:  # one long paragraph: cut at a sentence, else at a word
            cut = para.rfind(". ", 0, limit)
            if cut > limit // 2:
                para = para[: cut + 1]
            else:
                space = para.rfind(" ", 0, limit)
                para = para[: space if space > 0 else limit] + " ..."
        out.append(para)
        size += len(para) + 2
    return "\n\n".join(out)


def _comment_lines(raw: str) -> list[str]:
    """The text lines of one comment, its markers (``/**``, ``*/``, ``*``, ``//``) removed."""
    s = raw.strip()
    if s.startswith("/*"):
        s = s[2:-2] if s.endswith("*/") and len(s) >= 4 else s[2:]
        s = s.lstrip("*!")
        lines = []
        for line in s.split("\n"):
            line = line.strip()
            if line.startswith("*"):
                line = line[1:].strip()
            lines.append(line)
        return lines
    s = s.lstrip("/")
    return [(s[1:] if s.startswith("!") else s).strip()]


def _doc_text(lines: list[str], *, tags: bool) -> str:
    """Prose from cleaned comment lines: directives dropped, Javadoc/Doxygen tags ending it."""
    kept: list[str] = []
    for line in lines:
        if tags and line.startswith(_SUMMARY_TAGS):
            line = line.split(None, 1)[1] if " " in line else ""
        elif tags and line.startswith(("@", "\\", "# ")):
            break  # @param, @return, \param, Rust's "# Examples": the description is over
        if not line.startswith(_PRAGMAS):
            kept.append(line)
    return _describe(kept)


# --------------------------------------------------------------------------- Python

_FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def _py_arg(arg: ast.arg, default: ast.expr | None = None) -> str:
    s = arg.arg
    if arg.annotation is not None:
        s += f": {ast.unparse(arg.annotation)}"
    if default is not None:
        value = ast.unparse(default)
        if len(value) > _LONG_DEFAULT or "\n" in value:
            value = "..."
        s += f" = {value}" if arg.annotation is not None else f"={value}"
    return s


def _py_args(a: ast.arguments) -> str:
    """The parameter list as declared, long default values elided."""
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += a.defaults
    parts = []
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        parts.append(_py_arg(arg, default))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg is not None:
        parts.append("*" + _py_arg(a.vararg))
    elif a.kwonlyargs:
        parts.append("*")
    parts += [_py_arg(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg is not None:
        parts.append("**" + _py_arg(a.kwarg))
    return ", ".join(parts)


def _py_comment(lines: list[str], start: int) -> str:
    """The ``#`` block directly above line ``start`` (1-based), as prose.

    Only comments at the definition's own indentation: a deeper one closes the block above.
    """
    head = lines[start - 1]
    indent = head[: len(head) - len(head.lstrip())] + "#"
    i = start - 2
    block: list[str] = []
    while i >= 0 and lines[i].startswith(indent):
        block.append(lines[i].strip().lstrip("#").strip())
        i -= 1
    return _doc_text(block[::-1], tags=False) if block else ""


def _cut_docstring(
    seg: list[str], start: int, body: list[ast.stmt], lines: list[str]
) -> tuple[list[str], int, str] | None:
    """``seg`` (the unit's lines from ``start``) without its docstring, where it was, its indent.

    None when the docstring shares a line with other code (``def f(): "doc"``).
    """
    doc = body[0]
    first, last = doc.lineno, doc.end_lineno or doc.lineno
    line = lines[first - 1]
    indent = line[: len(line) - len(line.lstrip())]
    if len(indent) != doc.col_offset:  # the docstring follows the header on its line
        return None
    rest = lines[last - 1].encode()[doc.end_col_offset or 0 :].decode(errors="replace").strip()
    rest = rest[1:].strip() if rest.startswith(";") else rest
    if (rest and not rest.startswith("#")) or (len(body) > 1 and body[1].lineno <= last):
        return None
    lo, hi = first - start, last - start + 1
    while hi < len(seg) and not seg[hi].strip():
        hi += 1  # blank lines after the docstring (between statements: no string content)
    return seg[:lo] + ([indent + "pass"] if len(body) == 1 else []) + seg[hi:], lo, indent


def _python_units(text: str, path: str, min_lines: int, max_bytes: int) -> list[CodeUnit]:
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # ast counts all three as newlines
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences warn at parse time
            tree = ast.parse(text, path)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.split("\n")
    out: list[CodeUnit] = []

    def emit(node: _FunctionNode | ast.ClassDef, owner: str | None) -> None:
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = node.end_lineno or node.lineno
        seg = lines[start - 1 : end]
        body = node.body
        head = ""
        has_doc = (
            isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        )
        if has_doc:
            cut = _cut_docstring(seg, start, body, lines)
            if cut is None:
                return
            seg, at, indent = cut
            # What the cut touched, to check: the header with `pass` where the docstring was.
            # (A class's body below is the file's own, moved left as one block by dedent().)
            head = "\n".join([*seg[:at], indent + "pass"]) + "\n"
        if len(seg) < min_lines:
            return
        code = "\n".join(seg) + "\n"
        if node.col_offset:
            code = textwrap.dedent(code)
            if code[:1].isspace():  # a string at a lower indentation defeated dedent()
                return
        name = node.name if owner is None else f"{owner}.{node.name}"
        kind: Kind = (
            "class" if isinstance(node, ast.ClassDef) else ("method" if owner else "function")
        )
        prompt, source = "", "docstring"
        if has_doc:
            doc = ast.get_docstring(node, clean=True) or ""
            prompt = _describe(doc.split("\n"))
        if not prompt:
            prompt, source = _py_comment(lines, start), "comment"
        if not prompt:
            source = "template"
            if isinstance(node, ast.ClassDef):
                prompt = f"Implement the class `{name}`."
            elif owner is None:
                prompt = f"Implement `{name}({_py_args(node.args)})`."
            else:
                prompt = f"Implement the method `{name}({_py_args(node.args)})`."
        if len(prompt.encode()) + len(code.encode()) > max_bytes:
            return
        if has_doc:
            probe = code if kind != "class" else head
            if node.col_offset:
                probe = textwrap.dedent(probe)
            if not parses(probe, "python"):
                return
        out.append(CodeUnit("python", path, start, end, kind, name, prompt, code, source))

    def visit(body: list[ast.stmt], owner: str | None) -> None:
        for node in body:
            if isinstance(node, _FunctionNode):
                emit(node, owner)
            elif isinstance(node, ast.ClassDef):
                emit(node, owner)
                visit(node.body, node.name if owner is None else f"{owner}.{node.name}")
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.AsyncWith | ast.TryStar):
                # definitions under `if sys.platform...:`, `try: ... except ImportError:`
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []), owner)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, owner)

    visit(tree.body, None)
    return out


# --------------------------------------------------------------------------- tree-sitter


@dataclass(frozen=True)
class _Rules:
    """Which node kinds are units in one grammar."""

    functions: frozenset[str]  #: function/method units (only with a body)
    classes: frozenset[str] = frozenset()  #: class units, whose methods are units too
    owners: frozenset[str] = frozenset()  #: scopes whose functions are methods, not units
    prefixes: frozenset[str] = frozenset()  #: decorator/attribute siblings of a unit
    sep: str = "."


_JS = _Rules(
    functions=frozenset(
        {"function_declaration", "generator_function_declaration", "method_definition"}
    ),
    classes=frozenset({"class_declaration", "abstract_class_declaration"}),
    prefixes=frozenset({"decorator"}),
)
_RULES: dict[str, _Rules] = {
    "javascript": _JS,
    "typescript": _JS,
    "go": _Rules(functions=frozenset({"function_declaration", "method_declaration"})),
    "java": _Rules(
        functions=frozenset({"method_declaration", "constructor_declaration"}),
        classes=frozenset({"class_declaration"}),
        owners=frozenset({"interface_declaration", "enum_declaration", "record_declaration"}),
    ),
    "rust": _Rules(
        functions=frozenset({"function_item"}),
        owners=frozenset({"impl_item", "trait_item"}),
        prefixes=frozenset({"attribute_item"}),
        sep="::",
    ),
    "c": _Rules(functions=frozenset({"function_definition"})),
    "cpp": _Rules(
        functions=frozenset({"function_definition"}),
        owners=frozenset({"class_specifier", "struct_specifier", "union_specifier"}),
        sep="::",
    ),
}
_COMMENTS = frozenset({"comment", "line_comment", "block_comment"})
_ALWAYS_METHODS = frozenset({"method_definition", "method_declaration", "constructor_declaration"})
_JS_DECLARATIONS = frozenset({"lexical_declaration", "variable_declaration"})
_JS_FUNCTION_VALUES = frozenset({"arrow_function", "function_expression", "function"})
_DEFAULT_FIELDS = ("value", "right", "default_value")  # TS/JS/C++ parameter defaults


def _end_row(node: Node) -> int:
    """The last row holding text of ``node`` (a line comment may end after its newline)."""
    end = node.end_point
    return end.row - 1 if end.column == 0 and end.row > node.start_point.row else end.row


def _text(node: Node | None) -> str:
    return "" if node is None or node.text is None else node.text.decode(errors="replace")


class _TreeSitterUnits:
    """One file through its tree-sitter grammar (a class to share the file's state)."""

    def __init__(self, text: str, path: str, language: str, min_lines: int, max_bytes: int):
        self.data = text.replace("\r\n", "\n").encode()
        self.path, self.language = path, language
        self.min_lines, self.max_bytes = min_lines, max_bytes
        self.rules = _RULES[language]
        tsx = language == "typescript" and path.lower().endswith(".tsx")
        self.grammar = "tsx" if tsx else language
        self.out: list[CodeUnit] = []

    def run(self) -> list[CodeUnit]:
        root = ts_parser(self.grammar).parse(self.data).root_node
        stack: list[tuple[Node, str | None]] = [(root, None)]
        while stack:  # iterative: deep expression trees must not hit the recursion limit
            node, owner = stack.pop()
            stack.extend(self._visit(node, owner)[::-1])
        self.out.sort(key=lambda u: (u.start_line, -u.end_line))  # a class before its methods
        return self.out

    def _qualify(self, owner: str | None, name: str) -> str:
        return name if owner is None or not owner else f"{owner}{self.rules.sep}{name}"

    def _visit(self, node: Node, owner: str | None) -> list[tuple[Node, str | None]]:
        """Emit the units among ``node``'s children; return the children to descend into."""
        rules, todo = self.rules, []
        for child in node.named_children:
            t = child.type
            if t in _COMMENTS:
                continue
            if t in rules.functions:
                if t == "method_definition" and node.type != "class_body":
                    continue  # a method of an object literal does not stand alone
                self._function(child, owner)
            elif t in rules.classes:
                name = self._qualify(owner, _text(child.child_by_field_name("name")))
                self._emit(child, child, "class", name, None)
                todo.append((child.child_by_field_name("body") or child, name))
            elif t in rules.owners:
                todo.append((child.child_by_field_name("body") or child, self._owner(child, owner)))
            elif t in _JS_DECLARATIONS and self.language in ("javascript", "typescript"):
                todo += self._declarations(child, owner)
            elif t == "template_declaration":
                inner = next((c for c in child.named_children if c.type in rules.functions), None)
                if inner is not None:
                    self._function(inner, owner, code_node=child)
                else:
                    todo.append((child, owner))
            else:
                todo.append((child, owner))
        return todo

    def _owner(self, node: Node, owner: str | None) -> str:
        typ = node.child_by_field_name("name") or node.child_by_field_name("type")
        name = re.split(r"[<\s]", _text(typ).strip(), maxsplit=1)[0]
        return self._qualify(owner, name) if name else ""

    def _declarations(self, decl: Node, owner: str | None) -> list[tuple[Node, str | None]]:
        """``const f = (x) => ...``: a function named by its declarator."""
        declarators = [c for c in decl.named_children if c.type == "variable_declarator"]
        todo = []
        for d in declarators:
            value = d.child_by_field_name("value")
            if value is None or value.type not in _JS_FUNCTION_VALUES:
                todo.append((d, owner))
                continue
            name = self._qualify(owner, _text(d.child_by_field_name("name")))
            params = value.child_by_field_name("parameters") or value.child_by_field_name(
                "parameter"
            )
            code_node = decl if len(declarators) == 1 else d
            kind: Kind = "method" if owner else "function"
            self._emit(code_node, decl, kind, name, params)
        return todo

    def _function(self, node: Node, owner: str | None, code_node: Node | None = None) -> None:
        if node.child_by_field_name("body") is None:
            return  # a declaration (abstract, interface, extern), not an implementation
        if self.language in ("c", "cpp"):
            found = self._c_name(node)
            if found is None:
                return
            name, params = found
        else:
            name = _text(node.child_by_field_name("name"))
            params = node.child_by_field_name("parameters")
        if node.type == "method_declaration" and self.language == "go":
            recv = node.child_by_field_name("receiver")
            typ = next((c for c in (recv.named_children if recv else ())), None)
            typ = typ.child_by_field_name("type") if typ is not None else None
            owner = re.split(r"[\[\s]", _text(typ).lstrip("*").strip(), maxsplit=1)[0] or None
        if not name:
            return
        kind: Kind = "method" if owner or node.type in _ALWAYS_METHODS else "function"
        code_node = code_node or node
        self._emit(code_node, code_node, kind, self._qualify(owner, name), params)

    @staticmethod
    def _c_name(node: Node) -> tuple[str, Node | None] | None:
        """Name and parameters from a C/C++ declarator chain (``*f(...)``, ``(*f(...))(...)``)."""
        d, fn = node.child_by_field_name("declarator"), None
        while d is not None:
            if d.type == "function_declarator":
                fn = d
            nxt = d.child_by_field_name("declarator")
            if nxt is None and d.type in ("parenthesized_declarator", "reference_declarator"):
                nxt = d.named_children[0] if d.named_children else None
            if nxt is None:
                break
            d = nxt
        if fn is None or d is None or d.type in ("parameter_list", "function_declarator"):
            return None
        return " ".join(_text(d).split()), fn.child_by_field_name("parameters")

    def _params(self, node: Node | None) -> str:
        """The parameter list's text, whitespace collapsed and long defaults elided."""
        if node is None:
            return "()"
        pieces, pos = [], node.start_byte
        for p in node.named_children:
            default = next(
                (v for f in _DEFAULT_FIELDS if (v := p.child_by_field_name(f)) is not None), None
            )
            if default is not None and (
                default.end_byte - default.start_byte > _LONG_DEFAULT
                or b"\n" in (default.text or b"")
            ):
                pieces += [self.data[pos : default.start_byte], b"..."]
                pos = default.end_byte
        pieces.append(self.data[pos : node.end_byte])
        s = " ".join(b"".join(pieces).decode(errors="replace").split())
        return s if s.startswith("(") else f"({s})"

    def _leading(self, anchor: Node) -> tuple[Node, list[Node]]:
        """The first decorator/attribute of ``anchor`` and the comment block right above it."""
        first, sib = anchor, anchor.prev_sibling
        while (
            sib is not None
            and sib.type in self.rules.prefixes
            and _end_row(sib) >= first.start_point.row - 1
        ):
            first, sib = sib, sib.prev_sibling
        comments: list[Node] = []
        row = first.start_point.row
        while sib is not None and sib.type in _COMMENTS and row - 1 <= _end_row(sib) <= row:
            comments.append(sib)
            row, sib = sib.start_point.row, sib.prev_sibling
        if comments and sib is not None and sib.end_point.row == comments[-1].start_point.row:
            comments.pop()  # a trailing comment of the code before, not documentation
        return first, comments[::-1]

    def _emit(
        self, code_node: Node, anchor: Node, kind: Kind, name: str, params: Node | None
    ) -> None:
        if code_node.has_error:
            return
        if anchor.parent is not None and anchor.parent.type == "export_statement":
            anchor = anchor.parent  # `export function f`: the comment sits above `export`
        first, comments = self._leading(anchor)
        head = code_node if first is anchor else first  # decorators belong to the code
        start, start_row = head.start_byte, head.start_point.row
        end_row = _end_row(code_node)
        if end_row - start_row + 1 < self.min_lines:
            return
        line_start = self.data.rfind(b"\n", 0, start) + 1
        if not self.data[line_start:start].strip():
            start = line_start  # keep the first line's indentation for dedent()
        code = self.data[start : code_node.end_byte].decode(errors="replace")
        if start != code_node.start_byte or code[:1].isspace():
            code = textwrap.dedent(code)
        code = code.rstrip() + "\n"
        prompt, source = "", "comment"
        if comments:
            lines = [line for c in comments for line in _comment_lines(_text(c))]
            prompt = _doc_text(lines, tags=True)
        if not prompt:
            source = "template"
            if kind == "class":
                prompt = f"Implement the class `{name}`."
            elif kind == "method":
                prompt = f"Implement the method `{name}{self._params(params)}`."
            else:
                prompt = f"Implement `{name}{self._params(params)}`."
        if len(prompt.encode()) + len(code.encode()) > self.max_bytes:
            return
        self.out.append(
            CodeUnit(
                self.language,
                self.path,
                start_row + 1,
                end_row + 1,
                kind,
                name,
                prompt,
                code,
                source,
            )
        )
