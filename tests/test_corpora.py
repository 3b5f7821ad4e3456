"""The built-in corpora and their checkers (support/corpora.py)."""

import ast
import json
import re
import textwrap

import pytest

from support import corpora


def test_stdlib_query_is_signature_and_docstring(stdlib):
    assert len(stdlib) > 1000
    for r in stdlib:
        assert r["query"].startswith(("def ", "async def ")), (r["module"], r["name"])
        fn = ast.parse(r["query"] + "    pass\n").body[0]  # the query alone is a complete header
        doc = ast.get_docstring(fn, clean=False)
        assert doc is not None and fn.name == r["name"].split(".")[-1]


def test_stdlib_query_plus_response_is_the_dedented_source(stdlib):
    lines = open(json.decoder.__file__, encoding="utf-8").read().split("\n")
    by_name = {r["name"]: r for r in stdlib if r["module"] == "json.decoder"}
    fn = by_name["JSONDecoder.raw_decode"]
    node = next(n for n in ast.walk(ast.parse("\n".join(lines)))
                if isinstance(n, ast.FunctionDef) and n.name == "raw_decode")
    indent = " " * node.col_offset  # a method: the def is indented once
    source = "".join(line.removeprefix(indent) + "\n"
                     for line in lines[node.lineno - 1:node.end_lineno])
    assert fn["query"] + fn["response"] == source
    assert fn["response"].strip() and fn["response"].endswith("\n")
    for r in stdlib:  # in general: both parts end a line, and together they parse
        assert r["query"].endswith("\n") and r["response"].endswith("\n") and r["response"].strip()
        ast.parse(r["query"] + r["response"])


def test_stdlib_has_methods_and_no_test_packages(stdlib):
    modules = {r["module"] for r in stdlib}
    assert "json.decoder" in modules and "json" in modules  # json/__init__.py is "json"
    assert not any(part in ("test", "tests", "idle_test") or part.startswith("test_")
                   for m in modules for part in m.split("."))
    assert any("." in r["name"] for r in stdlib)  # methods are qualified: Class.method


def test_function_records_skip_docstring_only_and_too_long():
    source = textwrap.dedent('''\
        @decorator
        def kept(a):
            """Doc
            on two lines."""
            return a

        def only_doc():
            """Nothing else."""

        def undocumented():
            return 1

        class C:
            async def m(self):
                "Doc."
                await self.x()

            def n(self):
                """Doc."""
                return """
        column 0"""
        ''')
    records = corpora.function_records(source, "mod")
    assert [r["name"] for r in records] == ["kept", "C.m", "C.n"]
    assert records[0]["query"] == 'def kept(a):\n    """Doc\n    on two lines."""\n'
    assert records[0]["response"] == "    return a\n"
    assert records[1]["query"] == 'async def m(self):\n    "Doc."\n'
    assert records[2]["response"] == '    return """\ncolumn 0"""\n'  # the def's indent only
    assert [r["name"] for r in corpora.function_records(source, "mod", max_chars=50)] == ["C.m"]


STEP = re.compile(r"(\d+)([+*-])(\d+)(?:([+-])(\d+))?=(\d+) (carry|borrow) (\d)")


def check_step(line):
    """Assert one worked step is arithmetically right; return (digit written, carry or borrow
    out)."""
    match = STEP.fullmatch(line)
    assert match, line
    x, op, y, op2, z, value, word, out = match.groups()
    x, y, value, out = int(x), int(y), int(value), int(out)
    result = {"+": x + y, "-": x - y, "*": x * y}[op]
    result += 0 if op2 is None else int(z) if op2 == "+" else -int(z)
    assert result == value, line
    if word == "carry":
        assert op in "+*" and out == value // 10, line
        return value % 10, out
    # "12-3-1=8 borrow 1": the top digit shows the 10 it borrowed
    assert op == "-" and 0 <= value <= 9 and out == int(x >= 10) and 0 <= x - 10 * out <= 9, line
    return value, out


def test_arith_answer_is_the_independently_computed_one(arith):
    assert len(arith) == 20000
    assert corpora.arithmetic_expected("Add 4821 and 937.\n") == "5758"
    assert corpora.arithmetic_expected("Subtract 937 from 4821.\n") == "3884"
    assert corpora.arithmetic_expected("Multiply 4821 by 7.\n") == "33747"
    with pytest.raises(ValueError, match="not an arithmetic query"):
        corpora.arithmetic_expected("Divide 4 by 2.\n")
    assert {r["query"].split()[0] for r in arith} == {"Add", "Subtract", "Multiply"}
    for r in arith:
        assert corpora.arithmetic_answer(r["response"]) == \
            corpora.arithmetic_expected(r["query"]), r


def test_arith_answer_extraction_takes_the_last_answer_line():
    assert corpora.arithmetic_answer("1+2=3 carry 0\nanswer: 12\nanswer: 345\n7") == "345"
    # a generation cut before "\n"
    assert corpora.arithmetic_answer("answer: 7") == "7"
    assert corpora.arithmetic_answer("1+2=3 carry 0\nansw") is None


def test_arith_worked_steps_are_correct_and_spell_the_answer(arith):
    assert corpora._add_steps(4821, 937) == ["1+7=8 carry 0", "2+3+0=5 carry 0", "8+9+0=17 carry 1",
                                          "4+0+1=5 carry 0"]
    assert corpora._subtract_steps(4821, 937) == ["11-7=4 borrow 1", "12-3-1=8 borrow 1",
                                               "18-9-1=8 borrow 1", "4-0-1=3 borrow 0"]
    for r in arith:
        *steps, last = r["response"].removesuffix("\n").split("\n")
        assert last.startswith("answer: ") and len(steps) >= 3
        digits = []
        for line in steps:                     # least significant column first
            digit, out = check_step(line)
            digits.append(digit)
        if out:
            # a final carry is the leading digit (a final borrow is wrong)
            digits.append(out)
        spelled = "".join(map(str, reversed(digits))).lstrip("0") or "0"
        assert spelled == corpora.arithmetic_expected(r["query"]), r


def test_arith_responses_are_48_to_128_byte_tokens(arith):
    # byte tokenizer, EOS included
    lengths = [len(r["response"].encode("utf-8")) + 1 for r in arith]
    assert sum(48 <= n <= 128 for n in lengths) >= 0.95 * len(lengths)


@pytest.mark.parametrize("line, expected", [
    ("parent, dot, me = name.rpartition('.')", 'parent, dot, me = name.rpartition(".")'),
    ("x = f'{a}' + b'y' + u'z' + 'w'", 'x = f"{a}" + b"y" + u"z" + "w"'),
    (r"""say('it\'s', 'a "b"', r'\d', '''doc''', "ok")""",
     r"""say('it\'s', 'a "b"', r'\d', '''doc''', "ok")"""),
    ("return {'a': 1}  # 'comment'", "return {\"a\": 1}  # 'comment'"),
])
def test_double_quoted_rewrites_plain_single_quoted_literals_only(line, expected):
    assert corpora.double_quoted(line) == expected


@pytest.mark.parametrize("line", ["x = 'abc", "call(a, 'b',"])
def test_double_quoted_refuses_what_is_not_a_line_of_python(line):
    with pytest.raises(ValueError, match="not a line of Python"):
        corpora.double_quoted(line)


def test_quote_records_are_lines_of_the_standard_library_and_their_edit():
    records = corpora.quote_records()
    assert len(records) > 15000 and len({r["query"] for r in records}) == len(records)
    by_module = {}
    for r in records:
        query, response = r["query"], r["response"]
        assert query.endswith("\n") and 0 < len(query) <= 73 and not query.startswith("#")
        assert response == corpora.double_quoted(query[:-1]) + "\n" != query
        assert len(response) == len(query)                   # every character stays in its place
        assert corpora.score("quotes", query, response) == {"exact": 1.0}
        assert corpora.score("quotes", query, query) == {"exact": 0.0}
        by_module.setdefault(r["module"], []).append(r)
    # each record is a real line
    lines = open(json.decoder.__file__, encoding="utf-8").read().splitlines()
    for r in by_module["json.decoder"]:
        assert lines[int(r["name"]) - 1].strip() + "\n" == r["query"]
    # only the built-in corpora are checked
    assert corpora.score("my_data.json", "q", "a") is None
