"""The README's commands, as a user copies them: every `python -m training.<cli> ...` line of
its code blocks, from the directory the block `cd`s into. `training.run` commands are
composed and checked as the CLI would (a sweep's first trial); the main command runs for 2
steps, and the report and export commands run on what it wrote; `training.plan` runs."""

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from tests.test_cli import run_module
from training import kuberay, plan
from training.config import compose_run_config

ROOT = Path(__file__).resolve().parent.parent
CLI = re.compile(r"python -m (training\.\w+)(.*)")


@dataclass(frozen=True)
class Command:
    module: str
    args: tuple[str, ...]
    cwd: Path
    line: int

    def __str__(self) -> str:
        return f"README.md:{self.line}: python -m {self.module} {' '.join(self.args)}"


def readme_commands() -> list[Command]:
    """Each CLI command of the README's indented code blocks, continuation lines joined,
    comments dropped; a block's `cd DIR && ...` sets where the commands after it run."""
    lines = (ROOT / "README.md").read_text().splitlines()
    found, cwd, joined, start = [], ROOT, "", 0
    for number, line in enumerate(lines, start=1):
        if not line.startswith("    "):
            cwd = ROOT if line.strip() and not line.startswith(" ") else cwd
            continue
        text = line.strip()
        if not joined:
            start = number
        joined += text.removesuffix("\\").strip() + " "
        if text.endswith("\\"):
            continue
        command, joined = joined.split("  #")[0].split(" # ")[0].strip(), ""
        if match := re.match(r"cd (\S+) &&", command):
            cwd = ROOT / match.group(1)
        if match := CLI.search(command):
            found.append(Command(match.group(1), tuple(shlex.split(match.group(2))), cwd, start))
    return found


COMMANDS = readme_commands()


def first_trial(args: tuple[str, ...]) -> list[str]:
    """A sweep's (`-m`) first trial: each swept override's first value."""
    if "-m" not in args:
        return list(args)
    overrides = [a for a in args if a != "-m"]
    trial = []
    for text, override in zip(
        overrides, OverridesParser.create().parse_overrides(overrides), strict=True
    ):
        if override.is_sweep_override():
            first = next(iter(override.sweep_string_iterator()))
            text = f"{override.get_key_element()}={first}"
        trial.append(text)
    return trial


def test_the_readme_shows_each_cli():
    modules = {command.module for command in COMMANDS}
    assert modules == {
        "training.run",
        "training.plan",
        "training.report",
        "training.export",
        "training.generate",
        "training.kuberay",
    }
    assert any(c.cwd == ROOT / "examples" for c in COMMANDS)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.module == "training.run"], ids=str)
def test_each_run_command_composes_as_written(command, monkeypatch):
    monkeypatch.chdir(command.cwd)
    trial = [a for a in first_trial(command.args) if not a.startswith("hydra")]
    compose_run_config(trial)


@pytest.mark.parametrize(
    "command",
    # A hybrid plan compiles the most candidates: the whole suite's, the others quick.
    [
        pytest.param(c, marks=[pytest.mark.slow] if "strategy=hybrid" in c.args else [])
        for c in COMMANDS
        if c.module == "training.plan"
    ],
    ids=str,
)
def test_each_plan_command_runs_as_written(command, monkeypatch):
    monkeypatch.chdir(command.cwd)
    assert plan.main(list(command.args)) == 0


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if c.module == "training.kuberay"], ids=str
)
def test_each_kuberay_command_renders_the_manifest_it_writes(command):
    args = list(command.args)
    written = args[args.index(">") + 1]
    assert kuberay.render(args[: args.index(">")]) == (command.cwd / written).read_text()


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if c.module == "training.generate"], ids=str
)
def test_each_generate_command_runs_on_an_exported_preset(command, tmp_path, monkeypatch, capsys):
    """`<run dir>/preset` stands for what a model=hub run exports: a tiny preset here."""
    pytest.importorskip("keras_hub")
    from tests.hub_presets import write_preset
    from training import generate

    preset = write_preset("gemma", tmp_path / "preset")
    args = [str(preset) if a.endswith("/preset") else a for a in command.args]
    monkeypatch.chdir(command.cwd)
    assert generate.main([*args, "--max-length", "48"]) == 0
    import keras_hub

    tokenizer = keras_hub.models.CausalLMPreprocessor.from_preset(str(preset)).tokenizer
    prompt = tokenizer.detokenize(tokenizer([args[1]]))[0]  # as the tiny vocabulary spells it
    # Line by line: the session's Ray instance may forward its workers' logs meanwhile.
    printed = capsys.readouterr().out.splitlines()
    assert any(line.strip().startswith(prompt.strip()) for line in printed), printed


@pytest.mark.ray
@pytest.mark.slow
def test_the_main_command_runs_and_the_report_and_export_commands_read_what_it_wrote(tmp_path):
    run_dir, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    main = next(c for c in COMMANDS if c.module == "training.run" and not c.args)
    result = run_module(
        main.module,
        "trainer.steps=2",
        f"checkpoint.dir={checkpoints}",
        f"hydra.run.dir={run_dir}",
        cwd=main.cwd,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"model: {run_dir / 'model.keras'}" in result.stdout
    written = {"outputs/<date>/<time>": str(run_dir), "<checkpoint.dir>": str(checkpoints)}
    for command in (c for c in COMMANDS if c.module in ("training.report", "training.export")):
        args = [written.get(a, a) for a in command.args if not a.startswith("[")]
        args = [a for a in args if not a.endswith("]")]  # optional arguments, in brackets
        assert not [a for a in args if "<" in a], command
        result = run_module(command.module, *args, cwd=command.cwd)
        assert result.returncode == 0, f"{command}: {result.stderr[-2000:]}"
    assert (run_dir / "report.png").exists() and (checkpoints / "model.keras").exists()
    assert os.path.getsize(checkpoints / "model.keras") > 0
