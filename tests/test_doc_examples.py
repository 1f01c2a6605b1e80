"""Every code block in README.md and docs/ runs as written, each in a fresh interpreter.

A block's language tag says whether it runs: Python blocks (```python, ``.. code-block::
python``, an rst literal block ``::`` under a Python highlight language, ``>>>`` examples)
run; shell commands and listings (```bash, ```console, ```text, ...) do not. A block with
no tag, or a tag that is neither, fails `test_every_block_says_whether_it_runs`: tag it.

A block that imports a GPU framework (CuPy, PyTorch, Numba, JAX, cuda.core, directly or
through graphpool's integration module) or asks for the CUDA backend needs the GPU: on the
simulator it is skipped, saying so, and it runs under the `gpu` marker. Every block also
runs on the GPU (``GRAPHPOOL_BACKEND=cuda``); the others run on the simulator
(``GRAPHPOOL_BACKEND=sim``). Each runs in its own interpreter, in a temporary directory
(a block may write files), from a file padded so that a traceback's line numbers are the
document's.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import graphpool as gp
from gpu_guard import FRAMEWORKS, OPTIONAL_MISSING, cuda_unusable

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/*.md", "docs/*.rst")

PYTHON = {"python", "py", "python3", "py3", "default"}  # "default": Sphinx's lenient Python
PYCON = {"pycon", "doctest"}  # >>> examples: the prompts' lines run, the output lines are dropped
TEXT = {"bash", "sh", "shell", "console", "shell-session", "text", "none", "output", "ini", "toml", "json"}
TEXT |= {"pytb", "yaml", "diff"}

# graphpool's integration modules and the framework each one drives
INTEGRATIONS = {
    "graphpool.cupy": "cupy",
    "graphpool.torch": "torch",
    "graphpool.numba": "numba",
    "graphpool.cuda_core": "cuda.core",
}
# what a framework is imported as, for the importability check
IMPORT_NAME = {"cuda.core": "cuda.core.experimental"}


@dataclass(frozen=True)
class Block:
    """One code block: where it is, its language tag and its text."""

    doc: str  # path relative to the repository root
    line: int  # line of the block's first line of code (1-based)
    lang: str  # the tag, lower case; "" when there is none
    code: str
    heading: str  # the section it is under, for the test id

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def source(self) -> str:
        """The Python the block runs (prompts stripped from a >>> example)."""
        if self.lang not in PYCON:
            return self.code
        out = []
        for line in self.code.splitlines():
            stripped = line.lstrip()
            out.append(stripped[4:] if stripped[:4] in (">>> ", "... ") else "")
            if stripped in (">>>", "..."):
                out[-1] = ""
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- extraction
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_MD_HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")


def markdown_blocks(doc: str, text: str) -> list[Block]:
    """The fenced code blocks of a Markdown document (list items' fences included)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    heading = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _FENCE.match(line.lstrip()) if line.strip().startswith(("```", "~~~")) else None
        if m is None:
            h = _MD_HEADING.match(line)
            if h is not None:
                heading = h.group("title")
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        fence = m.group("fence")
        info = m.group("info").strip()
        lang = info.split()[0].lower().strip("{}.") if info else ""
        body: list[str] = []
        i += 1
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                break
            body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
            i += 1
        start = i - len(body) + 1  # the first code line, 1-based
        blocks.append(Block(doc, start, lang, "\n".join(body) + "\n", heading))
        i += 1
    return blocks


_DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\.\s+(?P<name>[\w:-]+)::\s*(?P<arg>.*)$")
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+.:_])\1{2,}\s*$")


def _highlight_language() -> str:
    """docs/conf.py's highlight_language (Sphinx's default is "default", lenient Python)."""
    conf = ROOT / "docs" / "conf.py"
    m = (
        re.search(r"^highlight_language\s*=\s*['\"]([\w-]+)['\"]", conf.read_text(), re.M)
        if conf.exists()
        else None
    )
    return m.group(1).lower() if m else "default"


def _indented_body(lines: list[str], i: int, indent: int) -> tuple[list[str], int, int]:
    """The block indented past ``indent`` that starts at or after line ``i`` (skipping
    blank lines and directive options): its lines (dedented), its first line's index and
    the index after it."""
    while i < len(lines) and (not lines[i].strip() or lines[i].strip().startswith(":")):
        if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= indent:
            break  # an option line must be indented too; this is the next paragraph
        i += 1
    start = i
    body: list[str] = []
    while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
        body.append(lines[i])
        i += 1
    while body and not body[-1].strip():
        body.pop()
    if not body:
        return [], start, i
    cut = min(len(b) - len(b.lstrip()) for b in body if b.strip())
    return [b[cut:] for b in body], start, i


def rst_blocks(doc: str, text: str) -> list[Block]:
    """The code blocks of an rst document: code-block / code / sourcecode directives,
    literal blocks (``::``, in the current highlight language) and ``>>>`` examples."""
    blocks: list[Block] = []
    lines = text.splitlines()
    highlight = _highlight_language()
    heading = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        if i + 1 < len(lines) and line.strip() and _RST_UNDERLINE.match(lines[i + 1]):
            heading = line.strip()
        d = _DIRECTIVE.match(line)
        if d is not None:
            name, arg = d.group("name").lower(), d.group("arg").strip()
            if name == "highlight":
                highlight = arg.split()[0].lower() if arg else highlight
            if name in ("code-block", "code", "sourcecode", "doctest", "testcode"):
                lang = "pycon" if name == "doctest" else "python" if name == "testcode" else arg.lower()
                body, start, i = _indented_body(lines, i + 1, indent)
                blocks.append(Block(doc, start + 1, lang or highlight, "\n".join(body) + "\n", heading))
                continue
            i += 1
            continue  # any other directive's body is not a literal block of its own
        if line.rstrip().endswith("::"):
            body, start, i = _indented_body(lines, i + 1, indent)
            if body:
                blocks.append(Block(doc, start + 1, highlight, "\n".join(body) + "\n", heading))
            continue
        if line.lstrip().startswith(">>> ") and (i == 0 or not lines[i - 1].strip()):
            start = i
            while i < len(lines) and lines[i].strip():
                i += 1
            body = [b[indent:] for b in lines[start:i]]
            blocks.append(Block(doc, start + 1, "pycon", "\n".join(body) + "\n", heading))
            continue
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    blocks: list[Block] = []
    for pattern in DOCUMENTS:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            parse = rst_blocks if path.suffix == ".rst" else markdown_blocks
            blocks.extend(parse(rel, path.read_text()))
    return blocks


def runnable(block: Block) -> bool:
    return block.lang in PYTHON or block.lang in PYCON


# --------------------------------------------------------------------------- what a block needs
def _nodes(code: str) -> list[ast.AST]:
    """The block's syntax tree (empty when it does not parse: running it reports that)."""
    try:
        return list(ast.walk(ast.parse(code)))
    except SyntaxError:
        return []


def imported_modules(code: str) -> set[str]:
    """Every module the block imports (``import a.b`` gives a.b), parsed, not grepped."""
    mods: set[str] = set()
    for node in _nodes(code):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def frameworks(code: str) -> list[str]:
    """The GPU frameworks the block drives, in FRAMEWORKS' order."""
    needed: set[str] = set()
    for mod in imported_modules(code):
        for f in FRAMEWORKS:
            if mod == f or mod.startswith(f + "."):
                needed.add(f)
        for integration, f in INTEGRATIONS.items():
            if mod == integration or mod.startswith(integration + "."):
                needed.add(f)
    return [f for f in FRAMEWORKS if f in needed]


def asks_for_cuda(code: str) -> bool:
    """Whether the block selects the CUDA backend itself (``set_backend("cuda")``)."""
    for node in _nodes(code):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "set_backend"
            and any(isinstance(a, ast.Constant) and a.value == "cuda" for a in node.args)
        ):
            return True
    return False


def needs_gpu(block: Block) -> str | None:
    """Why the block needs a GPU, or None when it runs on the simulator."""
    code = block.source()
    fws = frameworks(code)
    if fws:
        return f"it drives {', '.join(fws)}"
    if asks_for_cuda(code):
        return 'it calls set_backend("cuda")'
    return None


def _importable(framework: str) -> bool:
    try:
        return importlib.util.find_spec(IMPORT_NAME.get(framework, framework)) is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- the tests
BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if runnable(b)]


def _id(block: Block) -> str:
    same = [b for b in RUNNABLE if b.doc == block.doc and b.heading == block.heading]
    slug = re.sub(r"[^\w]+", "-", block.heading.lower()).strip("-") or "top"
    return f"{block.doc}#{slug}-{same.index(block) + 1}"


def test_the_documents_have_python_blocks() -> None:
    """The extractor still finds the README's examples (a broken one would pass everything)."""
    if not (ROOT / "README.md").exists():
        pytest.skip("not run from a source checkout")
    readme = [b for b in RUNNABLE if b.doc == "README.md"]
    assert len(readme) >= 3, [b.where for b in BLOCKS]
    assert any(needs_gpu(b) is None for b in readme), "no README example runs on the simulator"


def test_every_block_says_whether_it_runs() -> None:
    """A block runs (a Python tag) or is text (a shell or listing tag); nothing in between."""
    unclear = [f"{b.where} ({b.lang or 'no tag'})" for b in BLOCKS if not runnable(b) and b.lang not in TEXT]
    assert not unclear, (
        "code blocks with no tag or an unknown one: tag each ```python (it runs) or "
        f"```text / ```console / ```bash (it does not): {unclear}"
    )


def test_extraction_finds_each_kind_of_block() -> None:
    """The extractors on a small document of each kind, including the forms the docs do not use yet."""
    md = "# A\n\n```python\nx = 1\n```\n\n- item\n\n  ```bash\n  ls\n  ```\n\n```\nbare\n```\n"
    got = [(b.line, b.lang, b.code, b.heading) for b in markdown_blocks("a.md", md)]
    assert got == [(4, "python", "x = 1\n", "A"), (10, "bash", "ls\n", "A"), (14, "", "bare\n", "A")]
    rst = (
        "Title\n=====\n\n.. code-block:: python\n   :caption: c\n\n   y = 2\n   z = 3\n\n"
        "Shell::\n\n   $ ls\n\n.. code-block:: console\n\n   $ pwd\n\n>>> 1 + 1\n2\n"
    )
    got = [(b.line, b.lang, b.code) for b in rst_blocks("a.rst", rst)]
    assert got == [
        (7, "python", "y = 2\nz = 3\n"),
        (12, _highlight_language(), "$ ls\n"),
        (16, "console", "$ pwd\n"),
        (18, "pycon", ">>> 1 + 1\n2\n"),
    ]
    assert Block("a.rst", 1, "pycon", ">>> a = 1\n... \n1\n", "").source() == "a = 1\n\n\n"


def test_what_a_block_needs_is_read_from_its_code() -> None:
    assert frameworks("import cupy, graphpool.cupy\n") == ["cupy"]
    assert frameworks("import graphpool as gp, graphpool.torch\n") == ["torch"]
    assert frameworks("from cuda.core.experimental import Device\nimport numpy\n") == ["cuda.core"]
    assert frameworks("import graphpool as gp\nfrom graphpool import xp\n") == []
    assert asks_for_cuda('import graphpool as gp\ngp.set_backend("cuda")\n')
    assert not asks_for_cuda('import graphpool as gp\ngp.set_backend("sim")\n')


@pytest.mark.parametrize("backend", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("block", RUNNABLE, ids=_id)
def test_block_runs_as_written(block: Block, backend: str, tmp_path: Path) -> None:
    gpu_reason = needs_gpu(block)
    fws = frameworks(block.source())
    if backend == "sim" and gpu_reason is not None:
        missing = [f for f in fws if not _importable(f)]
        note = f" ({', '.join(missing)} not importable here)" if missing else ""
        pytest.skip(f"{block.where} needs a GPU: {gpu_reason}{note}; it runs under the gpu marker")
    if backend == "cuda":
        reason = cuda_unusable()
        if reason is not None:
            pytest.skip(reason)
        for f in fws:
            if not _importable(f):
                pytest.skip(f"{OPTIONAL_MISSING} {f} (imported by {block.where})")
        if "torch" in fws and importlib.util.find_spec("graphpool._torch_shim") is None:
            if gp.compiled():
                raise AssertionError("the compiled install has no graphpool._torch_shim")
            pytest.skip(f"plain-Python install: {block.where} needs graphpool.torch's compiled shim")
    script = tmp_path / "block.py"
    script.write_text("\n" * (block.line - 1) + block.source())  # tracebacks give the document's lines
    src = str(Path(gp.__file__).resolve().parents[1])  # the graphpool this suite imports
    env = dict(os.environ, GRAPHPOOL_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        out = (r.stdout + r.stderr).replace(str(script), block.doc)
        pytest.fail(f"{block.where} ({backend}) exited with {r.returncode}:\n{out}", pytrace=False)


def test_ci_runs_the_readme_test_command() -> None:
    """`.ci/run` runs README's test command word for word, with CI=true set by itself (so
    the CI-only checks run there however it is started)."""
    ci = ROOT / ".ci" / "run"
    if not ci.exists() or not (ROOT / "README.md").exists():
        pytest.skip("not run from a source checkout")
    commands = [
        line.strip()
        for b in BLOCKS
        if b.doc == "README.md" and b.lang in ("bash", "sh", "console", "shell")
        for line in b.code.splitlines()
        if '".[test]"' in line and "pytest" in line and not line.lstrip().startswith("#")
    ]
    assert len(commands) == 1, commands
    lines = [line.strip() for line in ci.read_text().splitlines()]
    assert commands[0] in lines, (commands[0], lines)
    assert "export CI=true" in lines[: lines.index(commands[0])]
