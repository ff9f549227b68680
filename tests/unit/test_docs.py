"""The manual (``docs/``, ``mkdocs.yml``) and the README: the site builds with ``mkdocs build --strict``,
the shell commands of the getting-started and fine-tuning guides run, the recipe tables list every
recipe of ``recipes/`` as its file describes it, and the repository files they name exist.

The guides' commands run as written, each ```` ```bash ```` block as one ``bash -euo pipefail``
script, in order, in a fresh folder that holds what a reader would have: ``models/Qwen3-0.6B`` is a
tiny random Qwen3 written by transformers (`hf_checkpoints.make_hf_dir`), and each training command
gets `SHORT` appended (the last value of an override wins in Hydra). ```` ```sh ```` blocks (the
install command, which ``.ci/run`` runs) are left out. The whole of both guides is ``slow``; the
default run builds the site, checks that every training command of the guides composes (an override
naming no field fails) and runs the fine-tuning guide up to its first SFT run.

``python tests/unit/test_docs.py`` prints the recipe table of ``docs/recipes.md`` from the files.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GUIDES = ("getting-started.md", "fine-tuning.md")
SHORT = "trainer.max_steps=2"  # appended to every training command of the guides
COMMANDS = ("generate", "chat", "export", "merge", "compare", "plan", "data")  # plait's commands that train nothing
RESUME_SHORT = "trainer.max_steps=4"  # plait resume RUN_DIR: two steps past the guide's short run
# bash's `plait`: training commands get the short settings, the other commands and --help run as written.
PRELUDE = f"""
plait() {{
  case "${{1:-}}" in
    {"|".join(COMMANDS)}|-*) command plait "$@" ;;
    resume) command plait "$@" {RESUME_SHORT} ;;
    *) command plait "$@" {SHORT} ;;
  esac
}}
"""
REPO_DIRS = ("trainer", "strategies", "conf", "recipes", "tests", "bench", "docs")


def code_blocks(page: str, language: str = "bash") -> list[str]:
    """The ```` ```bash ```` (or other ``language``) blocks of a page of ``docs/``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", (DOCS / page).read_text(), flags=re.DOTALL | re.MULTILINE)


def plait_commands(block: str) -> list[list[str]]:
    """The argv (after ``plait``) of each ``plait`` command in a bash block (continuations joined,
    comments and heredoc bodies dropped)."""
    text = re.sub(r"<<'EOF'\n.*?^EOF$", "", block, flags=re.DOTALL | re.MULTILINE).replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word == "plait" and (i == 0 or words[i - 1] == "|"):
                found.append(words[i + 1 :])
    return found


def recipe_rows() -> list[str]:
    """One Markdown table row per bundled recipe and alias: its command, its first comment line,
    its objective and data (the config groups it composes) and the defaults a run most often changes."""
    from hydra import compose, initialize_config_dir

    from trainer.catalog import bundled_recipes
    from trainer.compose import hydra_config, register_resolvers, to_hydra_argv

    register_resolvers()
    rows = []
    for name, summary in bundled_recipes().items():
        config_dir, config_name, overrides = hydra_config(to_hydra_argv([name]))
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
        choices = cfg.hydra.runtime.choices
        defaults = (
            f"`optim.lr={cfg.optim.lr}`, `train.global_batch_size={cfg.train.global_batch_size}`, "
            f"`trainer.max_steps={cfg.trainer.max_steps}`"
        )
        rows.append(
            f"| `plait {name}` | {summary} | `objective={choices.objective}` | `data={choices.data}` | {defaults} |"
        )
    return rows


def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    """mkdocs-material is a dev dependency: a missing mkdocs fails here (python -m mkdocs), never skips."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert (tmp_path / "site" / "fine-tuning" / "index.html").is_file()


def test_recipe_tables_list_every_recipe() -> None:
    rows = recipe_rows()
    recipes_page = (DOCS / "recipes.md").read_text()
    assert [row for row in rows if row not in recipes_page] == []
    readme = (ROOT / "README.md").read_text()
    from trainer.catalog import bundled_recipes

    assert [name for name in bundled_recipes() if f"| `plait {name}` |" not in readme] == []


def test_named_repository_files_exist() -> None:
    """Every file path of the repository the README or a manual page names (as a link or in backticks)."""
    missing = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        for link in re.findall(r"\]\(([^)#\s]+)", text):
            if not link.startswith(("http://", "https://")):
                target = (page.parent / link).resolve()
                if not target.exists():
                    missing.append(f"{page.name}: ({link})")
        for path in re.findall(rf"`((?:{'|'.join(REPO_DIRS)})/[\w./-]+)`", text):
            if "<" not in path and "*" not in path and not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{page.name}: `{path}`")
    assert missing == []


def test_guides_training_commands_compose() -> None:
    """Each training command of the guides composes: an override that names no field, or a group
    option that does not exist, fails here in a second, without training."""
    from trainer.compose import compose, split_recipe

    commands = [argv for page in GUIDES for block in code_blocks(page) for argv in plait_commands(block)]
    training = [
        argv for argv in commands if not argv or (argv[0] not in (*COMMANDS, "resume") and not argv[0].startswith("-"))
    ]  # plait resume composes from a run directory: the slow test runs it
    assert len(training) >= 8, training
    failed = []
    for argv in training:
        recipe, overrides = split_recipe(argv)
        try:
            compose(recipe, overrides)
        except Exception as err:  # noqa: BLE001 - Hydra's and OmegaConf's errors alike
            failed.append(f"plait {shlex.join(argv)}: {type(err).__name__}: {err}")
    assert failed == []


@pytest.fixture
def reader_folder(tmp_path: Path) -> Path:
    """A folder with what the guides assume: a Hugging Face model at models/Qwen3-0.6B (tiny, random)."""
    from hf_checkpoints import make_hf_dir

    make_hf_dir("qwen3", tmp_path / "models" / "Qwen3-0.6B", max_position_embeddings=512)
    return tmp_path


def run_blocks(blocks: list[str], cwd: Path) -> None:
    """Runs each bash block as a script in ``cwd``, in order; fails on the first that fails."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for number, block in enumerate(blocks, 1):
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", PRELUDE + block],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, (
            f"block {number} exited {result.returncode}:\n{block}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )


def test_fine_tuning_guide_first_sft_runs(reader_folder: Path) -> None:
    """The fine-tuning guide up to its first SFT run (the data it writes, then the run), as written."""
    blocks = code_blocks("fine-tuning.md")
    first_sft = next(i for i, block in enumerate(blocks) if block.lstrip().startswith("plait sft"))
    run_blocks(blocks[: first_sft + 1], reader_folder)
    assert (reader_folder / "runs" / "sums-sft" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("page", GUIDES)
def test_guide_commands_run(page: str, reader_folder: Path) -> None:
    """Every bash block of the guide; after the fine-tuning guide, the Python API page's snippets
    (they load its runs)."""
    run_blocks(code_blocks(page), reader_folder)
    if page == "fine-tuning.md":
        snippets = [f"python - <<'EOF'\n{code}EOF\n" for code in code_blocks("python-api.md", "python")]
        run_blocks(snippets, reader_folder)


if __name__ == "__main__":
    print("| Recipe | What it trains | Objective | Data | Defaults |\n|---|---|---|---|---|")
    print("\n".join(recipe_rows()))
