"""The dashboard's pages (Streamlit). ``app.py`` is the outline; each ``*_page`` module
here lays out one page (a ``*_view`` one part of a page) from what ``viz`` computes. What
the pages share, by concept: ``catalog`` (where runs are, the picker, uploads),
``loaders`` (the cached loaders), ``job_controls`` (starting and watching jobs),
``tables`` (how a table is shown) and ``page_guard`` (a page that fails says so in one
line)."""
