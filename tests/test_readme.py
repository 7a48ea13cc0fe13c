from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if line.startswith("    pip install")]
    assert len(commands) == 2, "the README holds exactly two commands"
    main_job, tests = commands
    assert main_job.endswith("python -m stree demo")
    assert tests.endswith("python -m pytest -q")
    assert tests in (ROOT / ".ci" / "run").read_text()


def _examples() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return [block.split("```", 1)[0] for block in readme.split("```python\n")[1:]]


def test_the_readme_python_example_runs(capsys):
    exec(compile(_examples()[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "tau" in printed and "tok/s" in printed


def test_the_readme_reasoning_example_runs(capsys):
    exec(compile(_examples()[1], "README.md", "exec"), {})
    share, writers = capsys.readouterr().out.splitlines()[0].split(" ", 1)
    assert 0 <= float(share) <= 1 and ("small" in writers or "base" in writers)
