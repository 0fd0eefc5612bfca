"""Sphinx configuration of the course site: the notebooks rendered with MyST-NB.

Built by ``python scripts/build_site.py`` (which stages the notebooks next to this file and runs
Sphinx); see README.md, "The course site". Nothing is fetched at build time or when a page is viewed:
the theme comes from its Python package, and math is typeset in the browser by MathJax 2, copied
from the ``jupyter-server-mathjax`` package into the site.
"""
import shutil
from pathlib import Path

import jupyter_server_mathjax

project = "flashlab"
author = "the flashlab authors"
copyright = "the flashlab authors, MIT license"

extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# The notebooks come executed (scripts/execute_for_site.py) or not at all: never run at build time.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# Math: MathJax 2.7 from the jupyter-server-mathjax package, copied into _static/mathjax by
# copy_mathjax below (Sphinx's default, MathJax from a CDN, would need the network to show a formula).
MATHJAX_DIR = Path(jupyter_server_mathjax.__file__).parent / "static"
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
mathjax2_config = {
    "tex2jax": {"processEscapes": True, "ignoreClass": "highlight|output"},
    "HTML-CSS": {"availableFonts": [], "webFont": "STIX-Web", "imageFont": None, "preferredFont": None,
                 "scale": 92, "linebreaks": {"automatic": True}},
    "messageStyle": "none",
    "menuSettings": {"zoom": "None"},
}
myst_update_mathjax = False   # its settings are MathJax 3/4's

html_theme = "sphinx_book_theme"
html_title = "flashlab: FlashAttention-2, built step by step"
html_static_path = ["_static"]
html_css_files = ["flashlab.css"]
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "use_fullscreen_button": False,
}
html_last_updated_fmt = None


def copy_mathjax(app, exception):
    if exception is None and app.builder.format == "html":
        shutil.copytree(MATHJAX_DIR, Path(app.outdir) / "_static" / "mathjax", dirs_exist_ok=True)


def setup(app):
    app.connect("build-finished", copy_mathjax)
