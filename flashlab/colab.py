"""Running the course in Colab: the repository's address lives here, once.

Each notebook's first code cell is exactly :func:`install_cell`'s text and each Colab badge
is :func:`badge`'s (tests check both), so moving the repository means changing ``REPO_URL``
here; the tests then list every cell and badge still pointing at the old address.
"""
from __future__ import annotations

REPO_URL = "https://github.com/flashlab-course/flashlab"
BRANCH = "main"


def install_cell() -> str:
    return (
        "# Colab: install flashlab from the repository, leaving Colab's own torch and triton alone.\n"
        "# Anywhere else this cell does nothing (install locally with: pip install -r requirements.txt).\n"
        "import importlib.util, subprocess, sys\n"
        "if 'google.colab' in sys.modules and importlib.util.find_spec('flashlab') is None:\n"
        f"    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', 'git+{REPO_URL}@{BRANCH}'], check=True)"
    )


def badge(notebook_path: str) -> str:
    """Markdown for an 'Open in Colab' badge pointing at ``notebook_path`` in the repository."""
    slug = REPO_URL.split("github.com/")[1]
    url = f"https://colab.research.google.com/github/{slug}/blob/{BRANCH}/{notebook_path}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"
