"""
The built-in corpora as records {"query", "response", "module", "name"}, and their checkers.

    stdlib       every documented function of the standard library: signature and docstring -> body
    quotes       a line of the standard library's code -> its string literals double-quoted
    quotes-long  runs of such lines, answers of 32 to 512 bytes
    arith        20,000 worked arithmetic problems (arith-1m: a million; arith-small: 2 to 3 digits)
    transform    20,000 strings to copy, upper-case, shift or mirror (transform-long: 30 to 510)
    score        the metrics of a generated response, for the corpora whose answers code can check

Any other data set is a path (support/data_files.py); support/prepare.py tokenizes records.
"""

import ast
import io
import os
import random
import re
import sysconfig
import tokenize
from itertools import zip_longest

# -----------------------------------------------------------------------------
# the standard library's functions

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages"}
MAX_LINE = 72  # the longest line of code the quotes tasks take, in characters


def _stdlib_files(root: str) -> list[tuple[str, str]]:
    """(path, dotted module name) of the non-test .py files under `root`, in sorted order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("test_"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), root)[:-len(".py")]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files.append((os.path.join(dirpath, fn), ".".join(parts)))
    return sorted(files)


def _functions(tree: ast.AST, prefix: str = ""):
    """Yield (qualified name, node) for every (async) function, methods and nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")
        else:
            yield from _functions(node, prefix)  # defs under if/try/with keep the same prefix


def _dedent(lines: list[str], indent: str) -> list[str]:
    """`lines` less the `def` line's `indent` where they start with it; blank lines emptied. (Not
    textwrap.dedent: one string literal at column 0 would stop it dedenting anything.)"""
    return [line.removeprefix(indent) if line.strip() else "" for line in lines]


def function_records(source: str, module: str, max_chars: int | None = None) -> list[dict]:
    """Records of the documented functions in one module's `source` (newlines '\\n'): query, the
    lines from `def` to the docstring's end; response, the rest of the body (both dedented, each
    ending "\\n"). A function with nothing past its docstring, or longer than `max_chars`, is left
    out. Raises SyntaxError if `source` does not parse."""
    lines = source.split("\n")
    records = []
    for name, node in _functions(ast.parse(source)):
        if ast.get_docstring(node, clean=False) is None:
            continue
        # node.lineno is the `def` line; decorators have their own lines before it
        indent = lines[node.lineno - 1][:node.col_offset]
        body = _dedent(lines[node.lineno - 1:node.end_lineno], indent)
        head = node.body[0].end_lineno - node.lineno + 1  # lines up to the docstring's end
        query = "\n".join(body[:head]) + "\n"
        response = "\n".join(body[head:]) + "\n"
        too_long = max_chars is not None and len(query) + len(response) > max_chars
        if not response.strip() or too_long:
            continue
        records.append({"query": query, "response": response, "module": module, "name": name})
    return records


def stdlib_records() -> list[dict]:
    """stdlib: function_records of every module of this Python's standard library (tests and
    site-packages left out; files not UTF-8 or not parsing skipped, their count printed)."""
    root = sysconfig.get_paths()["stdlib"]
    records = []
    unreadable = 0
    for path, module in _stdlib_files(root):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            # ast counts \r\n and \r as line ends too; normalise so our line numbers agree
            source = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
            records += function_records(source, module)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            unreadable += 1
    if unreadable:
        print(f"stdlib_records: skipped {unreadable} files that are not UTF-8 or do not parse")
    return records

# -----------------------------------------------------------------------------
# the built-in code-editing corpus: the standard library's lines, their string quotes normalized


def double_quoted(line: str) -> str:
    """`line` with its single-quoted string literals double-quoted as black writes them ('a.b' ->
    "a.b", f'{x}' -> f"{x}"); a literal holding a quote or backslash, or triple-quoted, stays.
    Raises ValueError when the line does not tokenize as Python on its own."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, SyntaxError) as e:
        raise ValueError(f"not a line of Python: {line!r} ({e})") from None
    if any(tok.type == tokenize.ERRORTOKEN for tok in tokens):  # e.g. an unterminated string
        raise ValueError(f"not a line of Python: {line!r} (a token that is not Python's)")
    chars = list(line)
    for tok in tokens:
        if tok.type != tokenize.STRING or tok.start[0] != 1 or tok.end[0] != 1:
            continue
        prefix = len(tok.string) - len(tok.string.lstrip("rRbBuUfF"))
        body = tok.string[prefix:]
        # a plain single-quoted literal: no triple quotes, no quote or backslash in its text
        plain = body.startswith("'") and not body.startswith("'''")
        if plain and not set(body[1:-1]) & set("'\"\\"):
            chars[tok.start[1] + prefix] = '"'
            chars[tok.end[1] - 1] = '"'
    return "".join(chars)


def quote_records() -> list[dict]:
    """quotes: one record per distinct stripped line of the standard library's code (at most
    MAX_LINE characters, no comment) that double_quoted changes; query the line, response its
    rewrite, each ending "\\n"; name the line's number in its module."""
    records = []
    seen = set()
    for path, module in _stdlib_files(sysconfig.get_paths()["stdlib"]):
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#") or len(line) > MAX_LINE or line in seen:
                continue
            seen.add(line)
            try:
                edited = double_quoted(line)
            except ValueError:
                continue
            if edited != line:
                records.append({"query": line + "\n", "response": edited + "\n", "module": module,
                                "name": str(number)})
    return records


# quotes-long: answers (the rewrite, its newline and EOS) of exactly these many byte tokens, the
# length sweep's task (tools/bench_length.py)
BLOCK_TOKENS = (32, 64, 128, 256, 512)
BLOCK_END = "=>\n"  # ends a quotes-long query: the rewrite follows


def quote_block_records(n: int = 20000, lengths: tuple = BLOCK_TOKENS) -> list[dict]:
    """quotes-long: n records taking each length L of `lengths` in turn. query: a run of a
    module's stripped ASCII code lines (at most MAX_LINE characters, no blank or comment line)
    starting at one double_quoted changes, cut to L - 2 characters, then "\\n" and BLOCK_END;
    response: those characters rewritten line by line, and "\\n" (L byte tokens with EOS). A run
    cut inside a string literal is not used, so the query alone decides the response. name: the
    first line's number. The same records on every call."""
    modules = []
    for path, module in _stdlib_files(sysconfig.get_paths()["stdlib"]):
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f.read().splitlines()]
        except UnicodeDecodeError:
            continue
        modules.append((module, [line for line in lines if line and not line.startswith("#")
                                 and len(line) <= MAX_LINE and line.isascii()]))
    rewrites = {}

    def rewrite(line):  # double_quoted, None where the line is not Python on its own
        if line not in rewrites:
            try:
                rewrites[line] = double_quoted(line)
            except ValueError:
                rewrites[line] = None
        return rewrites[line]

    starts = [(m, i) for m, (_, lines) in enumerate(modules) for i, line in enumerate(lines)
              if rewrite(line) not in (None, line)]
    rng = random.Random(0)
    records = []
    seen = set()
    while len(records) < n:
        L = lengths[len(records) % len(lengths)]
        m, i = rng.choice(starts)
        module, lines = modules[m]
        run = lines[i:]
        size = next((k for k in range(1, len(run) + 1)
                     if sum(len(line) + 1 for line in run[:k]) > L - 2), None)
        if size is None or any(rewrite(line) is None for line in run[:size]):
            continue
        query = "\n".join(run[:size])[:L - 2]
        response = "\n".join(rewrite(line) for line in run[:size])[:L - 2]
        last = query.rsplit("\n", 1)[-1]
        if (not last.strip() or rewrite(last) != response.rsplit("\n", 1)[-1] or query in seen
                or query == response):   # the cut may leave out the first line's rewrite
            continue
        seen.add(query)
        records.append({"query": query + "\n" + BLOCK_END, "response": response + "\n",
                        "module": module, "name": str(i + 1)})
    return records


def quote_block_expected(query: str) -> str:
    """The correct response to a quotes-long query, its last newline left out. Raises ValueError if
    the query does not end with BLOCK_END or a line of it is not Python on its own."""
    if not query.endswith("\n" + BLOCK_END):
        raise ValueError(f"not a quotes-long query (it must end with {BLOCK_END!r}): {query!r}")
    return "\n".join(map(double_quoted, query[:-len(BLOCK_END) - 1].split("\n")))


# -----------------------------------------------------------------------------
# the built-in arithmetic corpus: column-by-column worked solutions with a checkable final answer

ARITH_DIGITS = (3, 6)  # operand digits; with the byte tokenizer responses are ~60 to ~125 tokens


def _columns(n: int) -> list[int]:
    """Decimal digits of n >= 0, least significant first."""
    return [int(c) for c in reversed(str(n))]


def _add_steps(a: int, b: int) -> list[str]:
    """One line per column of a + b, e.g. "8+9+0=17 carry 1" (the first column has no carry in)."""
    lines = []
    carry = 0
    for i, (x, y) in enumerate(zip_longest(_columns(a), _columns(b), fillvalue=0)):
        s = x + y + carry
        lines.append((f"{x}+{y}" if i == 0 else f"{x}+{y}+{carry}") + f"={s} carry {s // 10}")
        carry = s // 10
    return lines


def _subtract_steps(a: int, b: int) -> list[str]:
    """One line per column of a - b (a >= b), e.g. "12-3-1=8 borrow 1" (the top digit shown with
    the 10 it borrowed)."""
    lines = []
    borrow = 0
    for i, (x, y) in enumerate(zip_longest(_columns(a), _columns(b), fillvalue=0)):
        out = int(x - y - borrow < 0)
        top = x + 10 * out
        lines.append((f"{top}-{y}" if i == 0 else f"{top}-{y}-{borrow}") +
                     f"={top - y - borrow} borrow {out}")
        borrow = out
    return lines


def _multiply_steps(a: int, m: int) -> list[str]:
    """One line per column of a * m (m one digit), e.g. "2*7+4=18 carry 1"."""
    lines = []
    carry = 0
    for i, x in enumerate(_columns(a)):
        s = x * m + carry
        lines.append((f"{x}*{m}" if i == 0 else f"{x}*{m}+{carry}") + f"={s} carry {s // 10}")
        carry = s // 10
    return lines


def _operand(rng: random.Random, digits: tuple[int, int]) -> int:
    """A number whose digit count is uniform over digits (min, max)."""
    digits = rng.randint(*digits)
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _arith_problem(rng: random.Random, digits: tuple[int, int]) -> tuple[str, list[str], int]:
    """(query, worked step lines, answer) of one problem: add, subtract or multiply by one digit."""
    a = _operand(rng, digits)
    b = _operand(rng, digits)
    op = rng.choice(("add", "subtract", "multiply"))
    if op == "add":
        return f"Add {a} and {b}.\n", _add_steps(a, b), a + b
    if op == "subtract":
        a, b = max(a, b), min(a, b)
        return f"Subtract {b} from {a}.\n", _subtract_steps(a, b), a - b
    m = rng.randint(2, 9)
    return f"Multiply {a} by {m}.\n", _multiply_steps(a, m), a * m


def arithmetic_records(n: int = 20000, seed: int = 0,
                       digits: tuple[int, int] = ARITH_DIGITS) -> list[dict]:
    """arith: n distinct problems. query: "Add 4821 and 937.\\n", "Subtract 937 from 4821.\\n" or
    "Multiply 4821 by 7.\\n" (operands of `digits` digits, a multiplier of 2 to 9); response: a line
    per column, least significant first ("1+7=8 carry 0\\n..."), then "answer: 5758\\n". name: the
    record's index. Deterministic for a given seed."""
    rng = random.Random(seed)
    records = []
    seen = set()
    while len(records) < n:
        query, steps, answer = _arith_problem(rng, digits)
        if query in seen:
            continue  # a repeated problem could land in both splits and leak its answer into val
        seen.add(query)
        response = "".join(line + "\n" for line in steps) + f"answer: {answer}\n"
        records.append({"query": query, "response": response, "module": "arith",
                        "name": str(len(records))})
    return records


ARITH_QUERIES = (  # (query pattern, the answer from its two numbers), independent of the generator
    (re.compile(r"Add (\d+) and (\d+)\."), lambda a, b: a + b),
    (re.compile(r"Subtract (\d+) from (\d+)\."), lambda b, a: a - b),
    (re.compile(r"Multiply (\d+) by (\d+)\."), lambda a, b: a * b),
)


def arithmetic_expected(query: str) -> str:
    """The correct answer to an arith query. Raises ValueError for a query of no known form."""
    for pattern, op in ARITH_QUERIES:
        match = pattern.fullmatch(query.strip())
        if match:
            return str(op(int(match[1]), int(match[2])))
    raise ValueError(f"not an arithmetic query: {query!r}")


def arithmetic_answer(text: str) -> str | None:
    """A response's final answer: the rest of the line after its last "answer: ", stripped; None
    without one."""
    _, found, tail = text.rpartition("answer: ")
    return tail.split("\n", 1)[0].strip() if found else None

# -----------------------------------------------------------------------------
# the built-in transform corpus: responses that depend on the prompt, not on themselves

# name -> (letters per string, the response to a string of lowercase letters). Each output letter
# depends on one prompt letter only: where slot-parallel decoding commits many tokens a pass
TRANSFORMS = {
    "copy": (16, lambda s: s),
    "upper": (32, str.upper),
    # each letter to the next
    "shift": (48, lambda s: "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in s)),
    # a <-> z, b <-> y, ...
    "mirror": (63, lambda s: "".join(chr(219 - ord(c)) for c in s)),
}


def transform_records(n: int = 20000, lengths: tuple = ()) -> list[dict]:
    """transform: n distinct records. query: "<name>: <letters>\\n" for a name of TRANSFORMS and
    its count of random lowercase letters (with `lengths`, a count drawn from them); response: the
    transformed letters and "\\n". name: the record's index. The same records on every call."""
    rng = random.Random(0)
    records = []
    seen = set()
    while len(records) < n:
        name = rng.choice(sorted(TRANSFORMS))
        n_letters, transform = TRANSFORMS[name]
        n_letters = rng.choice(lengths) if lengths else n_letters
        letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n_letters))
        query = f"{name}: {letters}\n"
        if query in seen:
            continue
        seen.add(query)
        records.append({"query": query, "response": transform(letters) + "\n",
                        "module": "transform", "name": str(len(records))})
    return records


def transform_expected(query: str) -> str:
    """The correct response to a transform query, its newline left out. Raises ValueError for a
    query that is not "<transform>: <lowercase letters>"."""
    match = re.fullmatch(r"(\w+): ([a-z]+)", query.strip())
    if not match or match[1] not in TRANSFORMS:
        raise ValueError(f"not a transform query: {query!r}")
    return TRANSFORMS[match[1]][1](match[2])

# -----------------------------------------------------------------------------
# checking a generated response


def score(dataset: str, query: str, text: str, reference: str = "") -> dict[str, float] | None:
    """{metric: float} of a generated response `text` (no EOS) to `query`; None for a data set
    code cannot check. The first metric is the quality measure: "exact" (quotes, transform; with
    "letters", the share of characters right, for quotes-long and transform-long), "accuracy"
    (arith*), "parse_rate" (stdlib: a statement parses after the docstring; with "first_line",
    the first line is the `reference`'s)."""
    if dataset == "quotes":
        return {"exact": float(text == double_quoted(query.rstrip("\n")) + "\n")}
    if dataset == "transform":
        return {"exact": float(text == transform_expected(query) + "\n")}
    if dataset in ("transform-long", "quotes-long"):  # and the share written in place
        want = (transform_expected if dataset == "transform-long" else quote_block_expected)(query)
        return {"exact": float(text == want + "\n"),
                "letters": sum(a == b for a, b in zip(text, want)) / len(want)}
    if dataset.startswith("arith"):
        return {"accuracy": float(arithmetic_answer(text) == arithmetic_expected(query))}
    if dataset != "stdlib":
        return None
    try:
        parses = len(ast.parse(query + text).body[0].body) > 1
    except (SyntaxError, ValueError, IndexError, AttributeError):
        parses = False
    return {"parse_rate": float(parses),
            "first_line": float(text.split("\n")[0] == reference.split("\n")[0])}


# transform-long: answers (letters, newline, EOS) of 32 to 512 byte tokens (tools/bench_length.py)
LONG_LETTERS = (30, 62, 126, 254, 510)
# arith-1m's first 20,000 records are arith's, in the same splits
DATASETS = {"stdlib": stdlib_records, "quotes": quote_records, "arith": arithmetic_records,
            "transform": transform_records,
            "transform-long": lambda: transform_records(20000, lengths=LONG_LETTERS),
            "quotes-long": quote_block_records,
            "arith-1m": lambda: arithmetic_records(1_000_000),
            "arith-small": lambda: arithmetic_records(20000, digits=(2, 3))}


if __name__ == "__main__":  # python support/corpora.py
    raise SystemExit("error: support/corpora.py is a module of support/, not a command; the "
                     "commands are train.py, sampler.py and python -m tools.<name> "
                     "(tools/__init__.py lists them)")
