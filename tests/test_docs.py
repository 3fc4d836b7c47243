"""Every code block of the documentation runs, so the docs cannot drift from the code."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)
NOT_RUN = "# TensorFlow (before)"  # TensorFlow is not a dependency: shown, not run


def blocks(page: Path, language: str) -> list[str]:
    return [code for lang, code in FENCE.findall(page.read_text()) if lang == language]


def page_script(page: Path) -> str:
    runnable = [
        code
        for code in blocks(page, "python")
        if not SNIPPET.search(code) and not code.startswith(NOT_RUN)
    ]
    return "\n\n".join(runnable)


@pytest.mark.parametrize("page", [p for p in DOCS if page_script(p)], ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path):
    script = tmp_path / f"doc_{page.stem}.py"  # not keras.py: it would shadow `import keras`
    script.write_text(page_script(page))
    env = subprocess_env()
    result = subprocess.run(
        ["timeout", "-k", "10", "300", sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert result.returncode == 0, f"{page.name}:\n{result.stderr[-3000:]}"


def test_included_snippets_are_tested_examples():
    included = {m for page in DOCS for m in SNIPPET.findall(page.read_text())}
    assert included == {
        "examples/custom_loop.py",
        "examples/fit.py",
        "examples/multi_worker.py",
        "examples/cnn_digits.py",
        "examples/transformer_lm.py",
        "examples/tutorial_multi_worker_custom_training.py",
        "examples/tutorial_keras.py",
        "examples/flax_mnist_tutorial.py",
        "examples/keras_custom_loop.py",
        "examples/keras_jax_guide.py",
    }
    for path in included:
        assert (ROOT / path).exists(), path


def test_shell_commands_exist():
    makefile = (ROOT / "Makefile").read_text()
    commands = set()
    for page in [*DOCS, ROOT / "README.md"]:
        for code in blocks(page, "bash"):
            for line in code.splitlines():
                words = line.split("#")[0].split()
                if words[:1] == ["mirrored"]:
                    commands.add(words[1])
                elif words[:1] == ["make"]:
                    assert re.search(rf"^{words[1]}:", makefile, re.MULTILINE), line
    assert commands >= {"demo", "doctor", "launch"}
    for command in sorted(commands):
        result = subprocess.run(
            [sys.executable, "-m", "mirrored.cli", command, "--help"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, command
