"""Units of ingested source files (privcode.data.ingest.units) and the syntax helpers.

Every case is a real snippet with hand-counted line spans: the prompt must be the unit's
own documentation (else a signature-only template), the code must not contain that
documentation, and Python code must parse on its own.
"""

from __future__ import annotations

import ast
import textwrap

import pytest

from privcode.data.ingest.syntax import parses, structural_tokens
from privcode.data.ingest.units import LANGUAGES, CodeUnit, extract_units, language_of


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _by_name(units: list[CodeUnit]) -> dict[str, CodeUnit]:
    return {u.name: u for u in units}


# --------------------------------------------------------------------------- languages


@pytest.mark.parametrize(
    ("path", "language"),
    [
        ("pkg/mod.py", "python"),
        ("web/app.mjs", "javascript"),
        ("web/View.JSX", "javascript"),
        ("src/a.ts", "typescript"),
        ("src/App.tsx", "typescript"),
        ("cmd/main.go", "go"),
        ("A.java", "java"),
        ("lib.rs", "rust"),
        ("x.h", "c"),
        ("x.hpp", "cpp"),
        ("x.cc", "cpp"),
        ("README.md", None),
        ("Makefile", None),
    ],
)
def test_language_of(path, language):
    assert language_of(path) == language


def test_languages_table_and_unknown_language():
    assert LANGUAGES["typescript"] == (".ts", ".tsx")
    assert set(LANGUAGES) == {
        "python",
        "javascript",
        "typescript",
        "go",
        "java",
        "rust",
        "c",
        "cpp",
    }
    with pytest.raises(ValueError, match="cobol"):
        extract_units("", "a.cob", "cobol")


# --------------------------------------------------------------------------- Python

PY = _src(
    '''
    import os


    def documented(path, mode="r"):
        """Read a whole file.

        The second paragraph is kept too.

        >>> documented("x")  # doctests are not part of the prompt
        """
        with open(path, mode) as fh:
            return fh.read()


    # Join two paths,
    # the portable way.
    def commented(a, b):
        sep = os.sep
        return a + sep + b


    def plain(items, key=lambda item: item.priority * 10 + item.weight, *, reverse=False):
        secret_body_marker = sorted(items, key=key)
        return secret_body_marker[::-1] if reverse else secret_body_marker


    # Cached forever.
    @staticmethod
    @decorate(
        1,
    )
    def decorated(x):
        y = x + 1
        return y


    def tiny():
        return 1


    class Store:
        """A key-value store."""

        def __init__(self):
            """Start empty."""

        def get(self, key):
            value = self.data[key]
            return value

        async def fetch(self, key):
            """Fetch remotely."""
            got = await self.remote(key)
            return got
    '''
)


@pytest.fixture(scope="module")
def py_units() -> dict[str, CodeUnit]:
    return _by_name(extract_units(PY, "pkg/mod.py", "python"))


def test_python_docstring_becomes_the_prompt_and_leaves_the_code(py_units):
    u = py_units["documented"]
    assert (u.kind, u.prompt_source, u.start_line, u.end_line) == ("function", "docstring", 4, 12)
    assert u.prompt == "Read a whole file.\n\nThe second paragraph is kept too."
    assert u.code == (
        'def documented(path, mode="r"):\n    with open(path, mode) as fh:\n'
        "        return fh.read()\n"
    )
    assert "Read a whole file" not in u.code and '"""' not in u.code
    ast.parse(u.code)


def test_python_comment_block_above(py_units):
    u = py_units["commented"]
    assert (u.prompt_source, u.start_line, u.end_line) == ("comment", 17, 19)
    assert u.prompt == "Join two paths, the portable way."
    assert u.code.startswith("def commented(a, b):") and "#" not in u.code


def test_python_template_prompt_has_signature_only(py_units):
    u = py_units["plain"]
    assert u.prompt_source == "template"
    assert u.prompt == "Implement `plain(items, key=..., *, reverse=False)`."
    assert "secret_body_marker" not in u.prompt and "priority" not in u.prompt
    assert "secret_body_marker" in u.code


def test_python_decorated_function_keeps_decorators(py_units):
    u = py_units["decorated"]
    assert (u.start_line, u.end_line) == (28, 34)
    assert u.prompt == "Cached forever." and u.prompt_source == "comment"
    assert u.code.startswith("@staticmethod\n@decorate(\n")
    ast.parse(u.code)


def test_python_too_short_and_min_lines(py_units):
    assert "tiny" not in py_units
    tiny = _by_name(extract_units(PY, "pkg/mod.py", "python", min_lines=2))["tiny"]
    assert (tiny.start_line, tiny.end_line, tiny.prompt) == (37, 38, "Implement `tiny()`.")


def test_python_class_and_methods(py_units):
    cls = py_units["Store"]
    assert (cls.kind, cls.start_line, cls.end_line) == ("class", 41, 54)
    assert cls.prompt == "A key-value store."
    assert "A key-value store" not in cls.code
    ast.parse(cls.code)
    assert "Store.__init__" not in py_units  # two lines once its docstring is cut
    two = _by_name(extract_units(PY, "pkg/mod.py", "python", min_lines=2))
    init = two["Store.__init__"]  # only a docstring: `pass` takes its place
    assert (init.kind, init.start_line, init.end_line) == ("method", 44, 45)
    assert init.prompt == "Start empty."
    assert init.code == "def __init__(self):\n    pass\n"
    get = py_units["Store.get"]
    assert get.prompt == "Implement the method `Store.get(self, key)`."
    assert get.code == "def get(self, key):\n    value = self.data[key]\n    return value\n"
    fetch = py_units["Store.fetch"]
    assert (fetch.kind, fetch.start_line, fetch.end_line) == ("method", 51, 54)
    assert (fetch.prompt, fetch.prompt_source) == ("Fetch remotely.", "docstring")
    for u in (init, get, fetch):
        assert not u.code[0].isspace()
        ast.parse(u.code)
    assert all(u.language == "python" and u.path == "pkg/mod.py" for u in py_units.values())


def test_python_nested_functions_are_not_units():
    src = _src(
        """
        def outer(x):
            def inner(y):
                return y * 2
            return inner(x)
        """
    )
    assert [u.name for u in extract_units(src, "a.py", "python")] == ["outer"]


def test_python_defs_under_if_are_dedented():
    src = _src(
        '''
        import sys
        if sys.platform == "win32":
            def native(path):
                """Windows flavour."""
                return path.replace("/", "\\\\")
        '''
    )
    (u,) = extract_units(src, "a.py", "python", min_lines=2)
    assert (u.name, u.start_line, u.end_line) == ("native", 3, 5)
    assert u.code.startswith("def native(path):\n    return")
    ast.parse(u.code)


def test_python_syntax_error_and_size_limit():
    assert extract_units("def broken(:\n    pass\n", "a.py", "python") == []
    assert extract_units("x = '\0'\n", "a.py", "python") == []
    assert extract_units(PY, "pkg/mod.py", "python", max_bytes=60) == []


def test_python_comment_of_the_block_above_is_not_documentation():
    src = _src(
        """
        def first(x):
            y = x + 1
            # the end of first
        def second(x):
            y = x - 1
            return y
        """
    )
    by = _by_name(extract_units(src, "a.py", "python"))
    assert by["second"].prompt_source == "template"


# --------------------------------------------------------------------------- tree-sitter

JS = _src(
    """
    /**
     * Add two numbers.
     * @param {number} a the first
     * @returns {number} the sum
     */
    export function add(a, b) {
      return a + b;
    }

    class Cart {
      // Total price of the items.
      total(items) {
        return items.reduce((s, i) => s + i.price, 0);
      }
    }

    const double = (x) => {
      return x * 2;
    };
    """
)


def test_javascript_jsdoc_method_and_arrow():
    units = extract_units(JS, "web/cart.js", "javascript", min_lines=3)
    assert [(u.kind, u.name, u.start_line, u.end_line) for u in units] == [
        ("function", "add", 6, 8),
        ("class", "Cart", 10, 15),
        ("method", "Cart.total", 12, 14),
        ("function", "double", 17, 19),
    ]
    by = _by_name(units)
    assert by["add"].prompt == "Add two numbers." and by["add"].prompt_source == "comment"
    assert by["add"].code == "function add(a, b) {\n  return a + b;\n}\n"
    assert by["Cart.total"].prompt == "Total price of the items."
    assert by["Cart.total"].code.startswith("total(items) {\n  return")  # dedented, no class
    assert "//" not in by["Cart.total"].code
    assert (
        by["double"].prompt == "Implement `double(x)`." and by["double"].prompt_source == "template"
    )
    assert by["double"].code.startswith("const double = (x) => {")
    assert by["Cart"].prompt == "Implement the class `Cart`."


def test_typescript_ts_and_tsx():
    ts = _src(
        """
        export class Box<T> {
          /** Wraps a value. */
          @logged
          wrap(value: T): Box<T> {
            return new Box<T>();
          }
        }
        """
    )
    by = _by_name(extract_units(ts, "src/box.ts", "typescript"))
    wrap = by["Box.wrap"]
    assert (wrap.kind, wrap.start_line, wrap.end_line) == ("method", 3, 6)
    assert wrap.prompt == "Wraps a value."
    assert wrap.code.startswith("@logged\nwrap(value: T): Box<T> {")
    tsx = _src(
        """
        // Greets the user.
        export const Hello = (props: { name: string }) => {
          return <div>Hello {props.name}</div>;
        };
        """
    )
    (u,) = extract_units(tsx, "src/Hello.tsx", "typescript")
    assert (u.name, u.kind, u.start_line, u.end_line) == ("Hello", "function", 2, 4)
    assert u.prompt == "Greets the user."
    assert parses(u.code, "typescript")
    assert extract_units(tsx, "src/Hello.ts", "typescript") == []  # JSX is an error in .ts


def test_go_function_and_method():
    src = _src(
        """
        package shop

        // Sum adds the prices.
        // It never fails.
        func Sum(prices []int) int {
        \tt := 0
        \tfor _, p := range prices {
        \t\tt += p
        \t}
        \treturn t
        }

        // Add puts an item in the cart.
        func (c *Cart) Add(item Item, qty int) error {
        \tc.items = append(c.items, item)
        \treturn nil
        }
        """
    )
    by = _by_name(extract_units(src, "shop/cart.go", "go"))
    assert (by["Sum"].kind, by["Sum"].start_line, by["Sum"].end_line) == ("function", 5, 11)
    assert by["Sum"].prompt == "Sum adds the prices. It never fails."
    add = by["Cart.Add"]
    assert (add.kind, add.start_line, add.end_line) == ("method", 14, 17)
    assert add.prompt == "Add puts an item in the cart."
    assert add.code.startswith("func (c *Cart) Add(") and "//" not in add.code
    assert parses(add.code, "go")


def test_java_javadoc_tags_dropped():
    src = _src(
        """
        package shop;

        public class Cart {
            /**
             * Adds an item to the cart.
             *
             * @param item the item
             * @return the new size
             */
            @Override
            public int add(Item item) {
                items.add(item);
                return items.size();
            }
        }
        """
    )
    by = _by_name(extract_units(src, "Cart.java", "java"))
    add = by["Cart.add"]
    assert (add.kind, add.start_line, add.end_line) == ("method", 10, 14)
    assert add.prompt == "Adds an item to the cart." and "@param" not in add.prompt
    assert add.code.startswith("@Override\npublic int add(Item item) {")
    assert "/**" not in add.code
    assert (by["Cart"].kind, by["Cart"].start_line, by["Cart"].end_line) == ("class", 3, 15)


def test_rust_doc_fn_and_impl_method():
    src = _src(
        """
        /// Parses a port number.
        ///
        /// # Errors
        /// Fails on garbage.
        #[inline]
        pub fn parse_port(s: &str) -> Result<u16, Error> {
            let n = s.parse()?;
            Ok(n)
        }

        pub struct Server { port: u16 }

        impl<T: Clone> Server {
            /// Starts listening.
            pub fn start(&self) -> bool {
                let ok = true;
                ok
            }
        }
        """
    )
    units = extract_units(src, "src/lib.rs", "rust")
    assert [(u.kind, u.name, u.start_line, u.end_line) for u in units] == [
        ("function", "parse_port", 5, 9),
        ("method", "Server::start", 15, 18),
    ]
    fn, method = units
    assert fn.prompt == "Parses a port number." and fn.code.startswith("#[inline]\npub fn")
    assert method.prompt == "Starts listening."
    assert method.code == "pub fn start(&self) -> bool {\n    let ok = true;\n    ok\n}\n"


def test_c_and_cpp_block_comments_and_inline_method():
    c_src = _src(
        """
        #include <stdio.h>

        /* Returns the larger
           of two ints. */
        static int *
        max_of(int a, int b)
        {
            return a > b ? a : b;
        }
        """
    )
    (c,) = extract_units(c_src, "src/max.c", "c")
    assert (c.name, c.kind, c.start_line, c.end_line) == ("max_of", "function", 5, 9)
    assert c.prompt == "Returns the larger of two ints."
    assert c.code.startswith("static int *\nmax_of(int a, int b)") and "/*" not in c.code
    cpp_src = _src(
        """
        namespace geo {
        class Point {
         public:
          /** Squared length. */
          double norm2() const {
            return x * x + y * y;
          }
          double x, y;
        };
        }  // namespace geo

        double scale(double v, double k = 2.0) {
          return v * k;
        }
        """
    )
    by = _by_name(extract_units(cpp_src, "geo.cpp", "cpp"))
    m = by["Point::norm2"]
    assert (m.kind, m.start_line, m.end_line, m.prompt) == ("method", 5, 7, "Squared length.")
    assert m.code.startswith("double norm2() const {")
    s = by["scale"]
    assert (s.kind, s.start_line, s.end_line) == ("function", 12, 14)
    assert s.prompt == "Implement `scale(double v, double k = 2.0)`."


def test_tree_sitter_skips_nodes_with_errors_and_declarations():
    src = "int ok(int a)\n{\n    return a;\n}\n\nint broken(int a)\n{\n    return a +;\n}\n"
    assert [u.name for u in extract_units(src, "a.c", "c")] == ["ok"]
    java = "interface Shape {\n    double area();\n    double perimeter(\n    );\n}\n"
    assert extract_units(java, "Shape.java", "java") == []


# --------------------------------------------------------------------------- syntax


@pytest.mark.parametrize(
    ("language", "tokens"),
    [
        ("python", {"def", "(", ":", "match", "**=", "lambda"}),
        ("go", {"func", "{", ":=", "chan"}),
        ("rust", {"fn", "->", "impl", "::"}),
        ("javascript", {"function", "=>", "const"}),
        ("typescript", {"interface", "=>", "/>"}),
        ("java", {"class", "public", ";"}),
        ("c", {"struct", "->", "#include"}),
        ("cpp", {"template", "::", "class"}),
    ],
)
def test_structural_tokens(language, tokens):
    got = structural_tokens(language)
    assert tokens <= got
    assert "identifier" not in got and "" not in got


@pytest.mark.parametrize(
    ("language", "good", "bad"),
    [
        ("python", "def f(x):\n    return x\n", "def f(x)\n    return x\n"),
        ("javascript", "function f(x) { return x; }", "function f(x) { return x; "),
        ("typescript", "const f = (x: number): number => x;", "const f = (x: number => x;"),
        ("typescript", "const e = <div>hi</div>;", "const e = <div>hi</span;"),
        ("go", "package p\nfunc F() int { return 1 }\n", "package p\nfunc F( int { return 1 }\n"),
        ("java", "class A { int f() { return 1; } }", "class A { int f() { return 1; }"),
        ("rust", "fn f() -> i32 { 1 }", "fn f( -> i32 { 1 }"),
        ("c", "int f(void) { return 1; }", "int f(void) { return 1 }"),
        ("cpp", "template <class T> T f(T x) { return x; }", "template <class T T f(T x) {}"),
    ],
)
def test_parses(language, good, bad):
    assert parses(good, language)
    assert not parses(bad, language)


def test_syntax_unknown_language():
    with pytest.raises(ValueError, match="fortran"):
        parses("x", "fortran")
    with pytest.raises(ValueError, match="fortran"):
        structural_tokens("fortran")
