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


def test_the_readme_python_example_runs(capsys):
    readme = (ROOT / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "tau" in printed and "tok/s" in printed
