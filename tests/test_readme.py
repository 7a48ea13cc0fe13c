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


def _examples(name: str = "README.md") -> list[str]:
    text = (ROOT / name).read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def test_the_readme_python_example_runs(capsys):
    exec(compile(_examples()[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "tau" in printed and "tok/s" in printed


def test_the_reasoning_example_runs(capsys):
    exec(compile(_examples("docs/reasoning.md")[0], "docs/reasoning.md", "exec"), {})
    share, writers = capsys.readouterr().out.splitlines()[0].split(" ", 1)
    assert 0 <= float(share) <= 1 and ("small" in writers or "base" in writers)


def test_the_readme_stays_short_and_every_link_in_it_and_the_docs_leads_somewhere():
    """The README is the front page (the rest is in docs/); a link to a moved or renamed result file
    or document fails here, as does any reference to the project workspace outside the repository."""
    import re

    readme = ROOT / "README.md"
    assert len(readme.read_bytes()) <= 10_500
    pages = [readme, *sorted((ROOT / "docs").glob("*.md"))]
    assert {p.name for p in pages} >= {"architecture.md", "kernels.md", "drafters.md", "reasoning.md",
                                       "tensor-parallel.md", "benchmarks.md"}
    for page in pages:
        text = page.read_text()
        assert "../shared" not in text, page
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
