"""The README's configuration table is `AppArgs`, row for row."""

from pathlib import Path

from app.config import args_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_lists_every_app_arg_as_the_model_describes_it():
    # Regenerate with: python -c "from app.config import args_table; print(args_table())"
    assert args_table() in README.read_text()
