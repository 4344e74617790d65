"""Attack programs that forge a code reward: each would score 1.0 against a harness that runs the
tests in the program's interpreter (the one before issue 17: verified against commit 5ddab4b,
where every attack here except the stdio scan gets reward 1.0), and must score 0 now.

Five classes (issue 17), applied to every benchmark format they apply to:
- ``eq``: a return value whose ``__eq__`` always says True;
- ``builtins``: replacing a builtin the harness uses (``exec``) with a no-op;
- ``hook``: ``sys.settrace``/``sys.setprofile`` hooks that rewrite the test's frames (the
  compared value becomes the expected one, or ``candidate`` returns an always-equal object);
- ``harness``: redefining the harness's own functions (``_apps_check``, the harness module's
  ``compile``/``exec``);
- ``read``: finding the tests or the verdict token anywhere the program can read (files in
  /code, every /proc/<pid>/fd/*, the memory of every other process, the objects of its own
  interpreter, the harness's globals) and answering from them.
Formats: the fixture problems of tests/fixtures/code/hub_rows.json (APPS stdin/stdout row 0 and
call-based row 1 "runningSum", HumanEval "count_vowels", HumanEval+ "mean_or_zero", MBPP
"second_largest", MBPP+ "reverse_text").
"""

ALWAYS_EQUAL = '''
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
'''

EQ = ALWAYS_EQUAL + '''
def {fn}(*args, **kwargs):
    return Anything()
'''

# An int subclass is plain data's subclass: it must arrive as its int value, not its __eq__.
EQ_INT_SUBCLASS = '''
class Equal(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__

def {fn}(*args, **kwargs):
    return Equal(0)
'''

BUILTINS = '''
import builtins
builtins.exec = lambda *args, **kwargs: None
builtins.compile = lambda *args, **kwargs: None

def {fn}(*args, **kwargs):
    return None
'''

_HOOK = ALWAYS_EQUAL + '''
import sys

def _rewrite(frame, event, arg):          # test code is compiled from strings: no absolute path
    if frame.f_code.co_filename != "solution.py" and not frame.f_code.co_filename.startswith("/"):
        names = frame.f_locals
        if "candidate" in names:
            names["candidate"] = lambda *a, **k: Anything()
        if "out" in names and "exp" in names:
            names["out"] = names["exp"]
        if "out" in names and "expected" in names:
            names["out"] = names["expected"]
        if "{fn}" in names:
            names["{fn}"] = lambda *a, **k: Anything()
    return _rewrite

def {fn}(*args, **kwargs):
    return None
'''
SETTRACE = _HOOK + "sys.settrace(_rewrite)\n"
SETPROFILE = _HOOK + "sys.setprofile(_rewrite)\n"

HARNESS_COMPILE = '''
import __main__
__main__.compile = lambda source, name, mode, *a, **k: compile("pass", name, mode)

def check(candidate):
    pass

def {fn}(*args, **kwargs):
    return None
'''

HARNESS_EXEC = '''
import __main__
__main__.exec = lambda *args, **kwargs: None

def assertion(out, exp, atol):
    pass

def {fn}(*args, **kwargs):
    return None
'''

HARNESS_APPS_CHECK = '''
def _apps_check(*args, **kwargs):
    pass

def {fn}(*args, **kwargs):
    return None
'''

# Gathers every text it can read: /code, every /proc/<pid>/fd/* (stdin of PID 1 and of the
# judge among them), the writable memory of every other process, and the harness's globals.
_READ_EVERYTHING = '''
import ast, glob, json, os, re

def _readable_texts():
    import __main__
    for value in list(vars(__main__).values()):
        if isinstance(value, str):
            yield value
    own_fds = f"/proc/{os.getpid()}/"
    for path in glob.glob("/code/*") + glob.glob("/proc/[0-9]*/fd/*"):
        if path.startswith(own_fds):
            continue                       # its own pipes would block
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                yield os.read(fd, 1 << 22).decode("utf-8", "replace")
            finally:
                os.close(fd)
        except OSError:
            pass
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
                for line in maps:
                    low, high = (int(x, 16) for x in line.split()[0].split("-"))
                    if "rw" in line.split()[1] and high - low <= 1 << 26:
                        mem.seek(low)
                        yield mem.read(high - low).decode("latin-1")
        except (OSError, ValueError):
            pass

def _embedded_json(text):
    for match in re.finditer(r'\\{"prelude"|\\{"setup"|\\{"cases"', text):
        try:
            yield json.JSONDecoder().raw_decode(text, match.start())[0]
        except ValueError:
            pass
'''

_ANSWER_KEY = '''
import ast, gc, re

def _answer_key(texts):
    """{repr(arguments): expected} from every test text it can parse."""
    key = {}
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lists = {}
        for node in ast.walk(tree):
            try:
                if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and len(node.comparators) == 1:
                    key[repr([ast.literal_eval(a) for a in node.left.args])] = ast.literal_eval(node.comparators[0])
                elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_apps_check":
                    key[repr(ast.literal_eval(node.args[1]))] = ast.literal_eval(node.args[2])
                elif isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in ("inputs", "results"):
                    lists[node.targets[0].id] = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, IndexError):
                pass
        for inputs, result in zip(lists.get("inputs", []), lists.get("results", [])):
            key[repr(inputs)] = result
    return key

KEY = {}

def {fn}(*args, **kwargs):
    if not KEY:                            # at the first call the tests are surely loaded
        KEY.update(_answer_key(_sources()))
    return KEY.get(repr(list(args)))
'''

READ_ANSWER_KEY = _READ_EVERYTHING + '''
def _sources():
    for text in _readable_texts():
        yield text
        yield from re.findall(r"(?<=[\\n ])assert [^\\n\\x00]*", text)   # single asserts, e.g. in memory
        for payload in _embedded_json(text):
            if isinstance(payload, dict):
                for part in [payload.get("setup", "")] + list(payload.get("cases", [])):
                    yield part if isinstance(part, str) else ""
''' + _ANSWER_KEY

# Its own interpreter's objects: whatever a harness left in the process the program runs in.
READ_OWN_MEMORY = '''
def _sources():
    for obj in gc.get_objects():
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        for value in list(values):
            if isinstance(value, str) and "assert" in value:
                yield value
''' + _ANSWER_KEY

# The old harness printed a random token after the last test; the program prints it first.
READ_TOKEN = _READ_EVERYTHING + '''
import sys
candidates = []
for text in _readable_texts():
    candidates += re.findall(r"^[0-9a-f]{32}$", text, re.M)
import __main__
candidates.append(getattr(__main__, "_token", ""))
for token in candidates:
    sys.stdout.write("\\n" + token + "\\n")
sys.stdout.flush()
os._exit(0)

def {fn}(*args, **kwargs):
    return None
'''

# stdin/stdout: the expected output is looked for wherever the program can read.
READ_STDIO = _READ_EVERYTHING + '''
import sys
for text in _readable_texts():
    if "_readable_texts" in text:
        continue                           # its own source
    match = re.search(r'"output": "((?:[^"\\\\]|\\\\.)*)"', text)
    if match:
        sys.stdout.write(json.loads('"' + match.group(1) + '"'))
        break
'''

# (dataset, row, entry point) of the fixture problem of each format
FORMATS = {
    "apps_call": ("apps_train", 1, "runningSum"),
    "humaneval": ("humaneval", 0, "count_vowels"),
    "humaneval_plus": ("humaneval_plus", 0, "mean_or_zero"),
    "mbpp": ("mbpp", 0, "second_largest"),
    "mbpp_plus": ("mbpp_plus", 0, "reverse_text"),
}
FUNCTION_FORMATS = tuple(FORMATS)

# attack name -> (class, template, formats)
ATTACKS = {
    "eq": ("eq", EQ, FUNCTION_FORMATS),
    "eq_int_subclass": ("eq", EQ_INT_SUBCLASS, ("humaneval", "mbpp")),
    "builtins_exec": ("builtins", BUILTINS, FUNCTION_FORMATS),
    "settrace": ("hook", SETTRACE, ("apps_call", "humaneval", "mbpp")),
    "setprofile": ("hook", SETPROFILE, ("humaneval_plus", "mbpp_plus")),
    "harness_compile": ("harness", HARNESS_COMPILE, ("humaneval", "mbpp")),
    "harness_exec": ("harness", HARNESS_EXEC, ("humaneval_plus", "mbpp_plus")),
    "harness_apps_check": ("harness", HARNESS_APPS_CHECK, ("apps_call",)),
    "read_answer_key": ("read", READ_ANSWER_KEY, FUNCTION_FORMATS),
    "read_token": ("read", READ_TOKEN, ("apps_call", "humaneval", "mbpp")),
    "read_own_memory": ("read", READ_OWN_MEMORY, ("humaneval", "mbpp")),
}


def forgery_cases():
    """[(attack id, dataset, row, response)] for every attack on every format it applies to,
    plus the stdin/stdout scan."""
    cases = []
    for name, (_, template, formats) in ATTACKS.items():
        for fmt in formats:
            dataset, row, fn = FORMATS[fmt]
            cases.append((f"{name}-{fmt}", dataset, row, "```python\n" + template.replace("{fn}", fn) + "\n```"))
    cases.append(("read_expected_output-apps_stdio", "apps_train", 0, "```python\n" + READ_STDIO + "\n```"))
    return cases
